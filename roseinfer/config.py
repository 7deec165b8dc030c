"""Engine and model configuration, and the engine arguments of the command line."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable
from dataclasses import dataclass, field, fields
from typing import Any

import torch

from roseinfer.errors import InvalidRequestError
from roseinfer.pooling_params import POOLING_TYPES

# What `--device auto` stands for when set (cpu, cuda, cuda:N): a machine's default without a flag
# on every command. The CPU test suite sets it to cpu on GPU machines, where `auto` would pick CUDA
# in bfloat16 for tests written against float32 CPU references.
DEVICE_ENV = "ROSEINFER_DEVICE"

logger = logging.getLogger("roseinfer")

ATTENTION_BACKENDS = ("auto", "cpp", "torch")
EXECUTOR_BACKENDS = ("uni", "mp")
CPU_ALLREDUCE = ("shm", "gloo")
# How weights are held (layers/linear.py): as the checkpoint has them, expanded, or quantized.
QUANTIZATION_METHODS = ("auto", "none", "int8", "int4")
GIB = 1024**3

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}
# --kv-cache-dtype also takes llama.cpp's q8_0: int8 codes and a float16 scale per 32 values, kept
# in an int8 pool whose rows hold both (see ModelConfig.kv_row_elements).
_KV_CACHE_DTYPES = {**_DTYPES, "q8_0": torch.int8}


def rope_scaling_type(scaling: dict[str, Any] | None) -> str:
    """The scaling's kind as transformers names it ("rope_type", or the older "type"); Phi-3's
    checkpoints spell LongRoPE "su" (and a few "yarn", which transformers reads as LongRoPE)."""
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    return "longrope" if kind == "su" else kind


@dataclass
class MoeConfig:
    """A mixture-of-experts FFN (models/moe.py): each token's router picks `top_k` of `num_experts`
    SwiGLU experts (softmax over all experts, then top-k; the k weights renormalised to sum to 1
    where `norm_topk_prob`, as Mixtral and Qwen3-MoE do, or left as they are, as OLMoE and
    Qwen2-MoE do)."""

    num_experts: int
    top_k: int
    intermediate_size: int  # each expert's FFN width
    norm_topk_prob: bool
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE: an always-on expert behind a sigmoid gate
    dense_layers: tuple[int, ...] = ()  # layers with a dense MLP (ModelConfig.intermediate_size)
    # gpt-oss's clamped SwiGLU (models/gpt_oss.py): gate clamped above, up on both sides at this
    # limit, then (up + 1) * gate * sigmoid(alpha * gate); None: plain SwiGLU.
    swiglu_limit: float | None = None
    swiglu_alpha: float = 1.0


@dataclass
class RecurrentConfig:
    """A hybrid model's recurrent layers (layers/recurrent): the recurrence they run (a registry
    name there), which layers (the others are full attention), and the recurrence's own parameters
    dataclass (e.g. GatedDeltaNetParams), read by its layer class and its state spec."""

    kind: str
    layers: tuple[int, ...]
    params: Any


@dataclass
class VisionConfig:
    """A vision-language checkpoint's image side (models/vision/): its encoder family and the
    checkpoint's own configuration, which that family reads."""

    family: str  # a key of models/vision.VISION_ENCODERS and multimodal/prompt_images
    hf_config: dict[str, Any]


@dataclass
class ModelConfig:
    """The architecture hyper-parameters a model implementation needs, whatever file they came from."""

    architecture: str  # "llama" (Llama, Mistral, SmolLM, Qwen2, Qwen3), "moe" (Mixtral, Qwen-MoE, OLMoE) or "gpt2"
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    max_position_embeddings: int
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2: biases on q, k, v
    qk_norm: bool = False  # Qwen3: RMSNorm on each head of q and k
    hidden_act: str = "silu"
    sliding_window: int | None = None
    # Which layers the window applies to ("sliding_attention" / "full_attention" per layer, as
    # transformers' layer_types); None: every layer (Mistral).
    layer_types: list[str] | None = None
    # Gemma 2/3: soft-capping of attention scores and of the final logits (cap * tanh(x / cap)),
    # queries scaled by query_pre_attn_scalar ** -0.5 instead of head_dim ** -0.5, the rotary base
    # of the sliding layers (Gemma 3; None: rope_theta), and RMSNorm weights stored as w for a scale
    # of norm_weight_offset + w (1.0 in Hugging Face checkpoints; GGUF files store 1 + w).
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    query_pre_attn_scalar: float | None = None
    rope_local_theta: float | None = None
    norm_weight_offset: float = 0.0
    rotary_dim: int | None = None  # partial rotary (Phi-4-mini): the first dimensions of each head; None: all
    eos_token_ids: list[int] = field(default_factory=list)
    name: str = ""
    moe: MoeConfig | None = None  # architecture "moe" (and Qwen3.5-MoE, Qwen3-Next)
    recurrent: RecurrentConfig | None = None  # hybrid models (Qwen3.5, Qwen3-Next): their recurrent layers
    # Settings only one family reads (Granite 4's multipliers), written and read by its model file,
    # so that a family's oddities do not become fields here.
    family_options: dict[str, Any] = field(default_factory=dict)
    qk_norm_full: bool = False  # OLMoE: one RMSNorm over all heads of q (and of k), not per head
    # gpt-oss: a learned logit per query head added to each softmax's denominator (attention sinks).
    attention_sinks: bool = False
    # The dtype a Hugging Face checkpoint's weights are stored in ("bfloat16", "float32", ...), which
    # --dtype auto follows on the CPU where it runs fast; None for GGUF files (float32 activations).
    checkpoint_dtype: str | None = None
    vision: VisionConfig | None = None  # a vision-language model's image encoder
    # Layers whose keys and values differ in shape from num_kv_heads x head_dim (Gemma 4's
    # full-attention layers: fewer, 512-wide heads): layer -> (KV heads, head size).
    layer_kv_dims: dict[int, tuple[int, int]] = field(default_factory=dict)
    # Layers that attend over an earlier layer's keys and values instead of computing their own
    # (Gemma 4's last num_kv_shared_layers): layer -> the layer whose KV pool it reads. They own
    # no pool of their own (see kv_pool_layers).
    kv_shared_layers: dict[int, int] = field(default_factory=dict)

    def layer_kv_shape(self, layer: int) -> tuple[int, int]:
        """(KV heads, head size) of a layer's keys and values."""
        return self.layer_kv_dims.get(layer, (self.num_kv_heads, self.head_dim))

    def kv_pool_layers(self, layers: Iterable[int] | None = None) -> list[int]:
        """The layers (of `layers`, default all) that own a KV pool: all but the shared ones."""
        layers = range(self.num_layers) if layers is None else layers
        return [layer for layer in layers if layer not in self.kv_shared_layers]

    def kv_row_elements(self, dtype: torch.dtype, head_dim: int | None = None) -> int:
        """Pool elements of one token's keys (or values) for one KV head: head_dim (default the
        model's), or for a q8_0 pool (int8) head_dim codes then a float16 scale (2 bytes) per 32."""
        head_dim = head_dim or self.head_dim
        return head_dim + head_dim // 16 if dtype == torch.int8 else head_dim

    def kv_block_bytes(
        self, block_size: int, dtype: torch.dtype, tensor_parallel_size: int = 1, num_layers: int | None = None,
        layers: Iterable[int] | None = None,
    ) -> int:
        """Bytes one KV block takes across all layers (or `num_layers` of them, or the `layers`
        listed: a KV cache group's), keys and values, on one rank (with tensor parallelism a rank
        holds only its KV heads; the rank with the most of them counts). Layers that share another
        layer's pool take no bytes of their own."""
        element = torch.tensor([], dtype=dtype).element_size()
        if layers is None and num_layers is not None:
            layers = range(num_layers)
        total = 0
        for layer in self.kv_pool_layers(layers):
            kv_heads, head_dim = self.layer_kv_shape(layer)
            heads = -(-kv_heads // tensor_parallel_size)
            total += 2 * block_size * heads * self.kv_row_elements(dtype, head_dim) * element
        return total

    @property
    def layer_windows(self) -> list[int | None]:
        """Every layer's sliding window (None: full attention); see common/kv_cache_spec.py."""
        return [self.layer_window(layer) for layer in range(self.num_layers)]

    @property
    def recurrent_layers(self) -> list[int]:
        """The layers that keep a recurrent state instead of a KV cache (see `recurrent`)."""
        return list(self.recurrent.layers) if self.recurrent is not None else []

    @property
    def long_rope_from(self) -> int | None:
        """LongRoPE: the original context, past which a sequence takes the long frequencies (see
        layers/rotary.long_rope); None for every other rotary embedding."""
        if rope_scaling_type(self.rope_scaling) != "longrope":
            return None
        return int(self.rope_scaling.get("original_max_position_embeddings") or self.max_position_embeddings)

    @property
    def context_length(self) -> int:
        """The longest sequence the model was made for (a sliding window does not bound it: its
        layers attend to the window's last tokens, see layer_window)."""
        return self.max_position_embeddings

    @property
    def attention_span(self) -> int | None:
        """How many of the last positions some layer still reads when every layer has a sliding
        window (the KV cache frees blocks before it); None when a layer reads the whole sequence."""
        windows = [self.layer_window(layer) for layer in range(self.num_layers)]
        return max(windows) if windows and None not in windows else None

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of layer `layer` (keys at positions > query position - window), or
        None where it attends to the whole sequence."""
        if not self.sliding_window:
            return None
        if self.layer_types is None or self.layer_types[layer] == "sliding_attention":
            return self.sliding_window
        return None


@dataclass
class SpeculativeConfig:
    """Speculative decoding, as vLLM's `--speculative-config` spells it. Only the draft-model-free
    "ngram" method (prompt lookup): the last n tokens (n from prompt_lookup_max down to
    prompt_lookup_min) are looked for earlier in the sequence, and the tokens that followed them
    are proposed. One forward pass verifies them; rejected ones are rolled back.

    `disable_by_batch_size`: no speculation in steps with more running requests than this (large
    batches are compute-bound, where verifying rejected drafts costs real time). A request whose
    drafts keep being rejected (acceptance under `min_acceptance_rate`) stops proposing for a while.
    """

    method: str = "ngram"
    num_speculative_tokens: int = 5
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    disable_by_batch_size: int = 4
    min_acceptance_rate: float = 0.25

    def __post_init__(self) -> None:
        def bad(field_name: str, message: str) -> InvalidRequestError:
            return InvalidRequestError(f"speculative_config.{field_name} {message}", f"speculative_config.{field_name}")

        if self.method != "ngram":
            raise bad("method", f"must be 'ngram' (the draft-model-free method), got {self.method!r}")
        if not 1 <= self.num_speculative_tokens <= 16:
            raise bad("num_speculative_tokens", f"must be in 1..16, got {self.num_speculative_tokens}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise bad("prompt_lookup_min", f"must be in 1..prompt_lookup_max, got {self.prompt_lookup_min}")
        if self.disable_by_batch_size < 1:
            raise bad("disable_by_batch_size", f"must be at least 1, got {self.disable_by_batch_size}")
        if not 0.0 <= self.min_acceptance_rate <= 1.0:
            raise bad("min_acceptance_rate", f"must be in [0, 1], got {self.min_acceptance_rate}")

    @classmethod
    def parse(cls, value: SpeculativeConfig | dict[str, Any] | str | None) -> SpeculativeConfig | None:
        """From a dict or its JSON text (the command line's form)."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as exc:
                raise InvalidRequestError(f"speculative_config is not valid JSON: {exc}", "speculative_config") from exc
        if not isinstance(value, dict):
            raise InvalidRequestError("speculative_config must be an object", "speculative_config")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise InvalidRequestError(
                f"speculative_config: unknown field(s) {unknown}; known: {sorted(known)}", "speculative_config"
            )
        return cls(**value)


@dataclass
class EngineConfig:
    """Everything the engine is built from. Field names follow vLLM's engine arguments."""

    model: str | None = None  # None: the default model (SmolLM2-135M-Instruct GGUF)
    tokenizer: str | None = None  # a directory; needed for the seed's bare checkpoints
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16 (auto: see resolve)
    quantization: str = "auto"  # auto | none | int8 | int4 (how weights are held; see layers/linear.py)
    block_size: int = 16
    # auto: the model's dtype. bfloat16 / float16 halve a float32 model's KV cache (memory and the
    # bytes decode attention reads); attention still computes in float32.
    kv_cache_dtype: str = "auto"
    kv_cache_memory: float | None = None  # GiB for the KV pool; default below
    num_kv_blocks: int | None = None  # overrides kv_cache_memory
    # A model with full-attention and sliding-window layers (Gemma): the blocks of each sliding
    # layers' pool (num_kv_blocks is then the full-attention layers'). None: what max_num_seqs
    # sequences hold at most in their windows (see resolve).
    num_kv_blocks_sliding: int | None = None
    max_num_seqs: int = 64
    # Tokens one step may run. None: 1024 on the CPU, where a step of 1024 prompt tokens takes
    # about 1.3 s and smaller steps let half of a burst see its first token sooner (TTFT p50 of 64
    # requests at once: 1.3 s with 1024, 2.4 s with 2048, same throughput); 8192 on a GPU.
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None  # default: the model's context length
    enable_prefix_caching: bool = True  # reuse the K/V of prompt prefixes computed before
    # A model with recurrent layers: how many state snapshots at block boundaries the prefix cache
    # keeps (core/kv_cache/recurrent_state.py). None: as many as a quarter of --kv-cache-memory holds,
    # up to 4 per sequence (core/kv_pool_plan.py); 0: none (no prefix caching for such a model).
    num_state_snapshots: int | None = None
    attention_backend: str = "auto"  # auto | cpp (compiled CPU decode kernel) | torch (SDPA)
    seed: int = 0
    served_model_name: str | None = None
    # Tensor parallelism (see roseinfer/distributed/): ranks, the executor that runs them, and
    # where they meet when they span hosts (torch.distributed's usual rendezvous settings).
    tensor_parallel_size: int = 1
    distributed_executor_backend: str | None = None  # None: "uni" for one rank, else "mp"
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None  # None on one host: a free port
    cpu_threads_bind: str = "auto"  # auto | none | core lists per local rank, e.g. "0-3|4-7"
    cpu_allreduce: str = "shm"  # CPU ranks on one host: shm (shared memory) | gloo
    speculative_config: SpeculativeConfig | dict[str, Any] | str | None = None
    # A thinking model's markup (roseinfer/reasoning: qwen3, deepseek_r1): its grammar constrains
    # the answer only, a thinking budget can close it, and the API splits thinking from answer.
    reasoning_parser: str | None = None
    # Embeddings (POST /v1/embeddings, LLM.embed): how a prompt's final-norm hidden states become
    # one vector when the request does not say: "last" (the last token's, as Qwen3-Embedding and
    # other decoder embedding models are trained) or "mean"; and whether it is scaled to unit length.
    pooling: str = "last"
    pooling_normalize: bool = True
    # Seconds one grammar may compile (structured outputs) before its requests fail with a 400
    # naming the field; 0: no limit. llguidance's own fuel limits end most pathological grammars
    # sooner (a grammar near them compiles in about 2 s here); this bounds what they let through.
    grammar_compile_timeout: float = 30.0
    # Images (vision-language models; multimodal/media.py): the hosts whose http(s) image URLs may
    # be fetched (None: none, only data URLs and base64), and the most images in one request.
    allowed_media_domains: list[str] | None = None
    limit_mm_per_prompt: int | None = None

    DEFAULT_KV_CACHE_GIB = 2.0

    def __post_init__(self) -> None:
        def bad(param: str, message: str) -> InvalidRequestError:
            return InvalidRequestError(f"{param} {message}", param=param)

        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise bad("block_size", f"must be a positive power of two, got {self.block_size}")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise bad("kv_cache_memory", f"must be > 0 GiB, got {self.kv_cache_memory}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise bad("num_kv_blocks", f"must be at least 1, got {self.num_kv_blocks}")
        if self.num_kv_blocks_sliding is not None and self.num_kv_blocks_sliding < 1:
            raise bad("num_kv_blocks_sliding", f"must be at least 1, got {self.num_kv_blocks_sliding}")
        if self.num_state_snapshots is not None and self.num_state_snapshots < 0:
            raise bad("num_state_snapshots", f"must be at least 0, got {self.num_state_snapshots}")
        if self.max_num_seqs < 1:
            raise bad("max_num_seqs", f"must be at least 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens is None:
            self.max_num_batched_tokens = 1024 if self.torch_device.type == "cpu" else 8192
        if self.max_num_batched_tokens < 1:
            raise bad(
                "max_num_batched_tokens", f"must be at least 1, got {self.max_num_batched_tokens}"
            )
        if self.max_model_len is not None and self.max_model_len < 2:
            raise bad("max_model_len", f"must be at least 2, got {self.max_model_len}")
        if self.dtype not in ("auto", *_DTYPES):
            raise bad("dtype", f"must be auto or one of {sorted(_DTYPES)}, got {self.dtype!r}")
        if self.kv_cache_dtype not in ("auto", *_KV_CACHE_DTYPES):
            raise bad("kv_cache_dtype", f"must be auto or one of {sorted(_KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}"
                      + (" (the 8-bit cache is llama.cpp's q8_0)" if self.kv_cache_dtype.startswith("fp8") else ""))
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise bad("attention_backend", f"must be one of {', '.join(ATTENTION_BACKENDS)}, got {self.attention_backend!r}")
        if self.quantization not in QUANTIZATION_METHODS:
            raise bad("quantization", f"must be one of {', '.join(QUANTIZATION_METHODS)}, got {self.quantization!r}")
        self.speculative_config = SpeculativeConfig.parse(self.speculative_config)
        if not self.grammar_compile_timeout >= 0:  # also refuses NaN
            raise bad("grammar_compile_timeout", f"must be >= 0 seconds (0: none), got {self.grammar_compile_timeout}")
        if self.limit_mm_per_prompt is not None and self.limit_mm_per_prompt < 0:
            raise bad("limit_mm_per_prompt", f"must be >= 0, got {self.limit_mm_per_prompt}")
        if self.pooling not in POOLING_TYPES:
            raise bad("pooling", f"must be one of {', '.join(POOLING_TYPES)}, got {self.pooling!r}")
        self.torch_device  # noqa: B018 - validates the device string early
        self._check_distributed()

    def _check_distributed(self) -> None:
        def bad(param: str, message: str) -> InvalidRequestError:
            return InvalidRequestError(f"{param} {message}", param=param)

        if self.tensor_parallel_size < 1:
            raise bad("tensor_parallel_size", f"must be at least 1, got {self.tensor_parallel_size}")
        if self.distributed_executor_backend not in (None, *EXECUTOR_BACKENDS):
            raise bad("distributed_executor_backend",
                      f"must be one of {', '.join(EXECUTOR_BACKENDS)}, got {self.distributed_executor_backend!r}")
        if self.distributed_executor_backend == "uni" and self.tensor_parallel_size > 1:
            raise bad("distributed_executor_backend",
                      "'uni' runs one rank in the engine's own process; tensor_parallel_size > 1 needs 'mp'")
        if self.nnodes < 1:
            raise bad("nnodes", f"must be at least 1, got {self.nnodes}")
        if self.tensor_parallel_size % self.nnodes:
            raise bad("nnodes", f"{self.nnodes} hosts cannot share {self.tensor_parallel_size} ranks evenly")
        if not 0 <= self.node_rank < self.nnodes:
            raise bad("node_rank", f"must be in 0..{self.nnodes - 1}, got {self.node_rank}")
        if self.nnodes > 1 and self.master_port is None:
            raise bad("master_port", "is required when the ranks span several hosts (nnodes > 1)")
        if self.master_port is not None and not 0 < self.master_port < 65534:
            raise bad("master_port", f"must be a TCP port below 65534 (it and the next two are used), got {self.master_port}")
        if self.cpu_allreduce not in CPU_ALLREDUCE:
            raise bad("cpu_allreduce", f"must be one of {', '.join(CPU_ALLREDUCE)}, got {self.cpu_allreduce!r}")
        parse_cpu_binding(self.cpu_threads_bind)  # raises on a malformed list

    @property
    def executor_backend(self) -> str:
        """The executor that runs the model: "uni" (in the engine's process) or "mp" (worker
        processes, one per tensor-parallel rank)."""
        if self.distributed_executor_backend is not None:
            return self.distributed_executor_backend
        return "mp" if self.tensor_parallel_size > 1 else "uni"

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineConfig:
        """Build from keyword arguments, rejecting unknown names with the list of known ones."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise InvalidRequestError(
                f"unknown engine argument(s) {unknown}; known: {sorted(known)}", param=unknown[0]
            )
        return cls(**kwargs)

    @property
    def torch_device(self) -> torch.device:
        name = (os.environ.get(DEVICE_ENV) or "auto") if self.device == "auto" else self.device
        where = f"device (from {DEVICE_ENV})" if name != self.device else "device"
        if name == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        try:
            device = torch.device(name)
        except RuntimeError as exc:
            raise InvalidRequestError(f"{where} {name!r} is not a valid device", "device") from exc
        if device.type == "cuda" and not torch.cuda.is_available():
            raise InvalidRequestError(f"{where} {name!r} was asked for but CUDA is not available", "device")
        if device.type not in ("cpu", "cuda"):
            raise InvalidRequestError(f"{where} must be cpu or cuda, got {name!r}", "device")
        return device

    @property
    def torch_dtype(self) -> torch.dtype:
        if self.dtype == "auto":  # before resolve(): bf16 where the hardware is made for it, fp32 on the CPU
            return torch.bfloat16 if self.torch_device.type == "cuda" else torch.float32
        return _DTYPES[self.dtype]

    @property
    def kv_cache_torch_dtype(self) -> torch.dtype:
        return self.torch_dtype if self.kv_cache_dtype == "auto" else _KV_CACHE_DTYPES[self.kv_cache_dtype]


# --cpu-threads-bind's syntax (distributed/cpu_binding.py plans the cores from it).
def parse_core_list(text: str) -> list[int]:
    """'0,2,4-7' -> [0, 2, 4, 5, 6, 7]."""
    cores: list[int] = []
    for part in text.split(","):
        part = part.strip()
        low, dash, high = part.partition("-")
        if not low.isdigit() or (dash and not high.isdigit()):
            raise InvalidRequestError(
                f"cpu_threads_bind: {text!r} is not a core list like '0,2,4-7'", "cpu_threads_bind"
            )
        first, last = int(low), int(high) if dash else int(low)
        if last < first:
            raise InvalidRequestError(f"cpu_threads_bind: range {part!r} runs backwards", "cpu_threads_bind")
        cores.extend(range(first, last + 1))
    return sorted(set(cores))


def parse_cpu_binding(spec: str) -> list[list[int]] | None:
    """The explicit per-rank core lists of `spec`, or None for "auto" and "none"."""
    if spec in ("auto", "none"):
        return None
    if not spec.strip():
        raise InvalidRequestError("cpu_threads_bind must be auto, none or core lists like '0-3|4-7'",
                                  "cpu_threads_bind")
    return [parse_core_list(part) for part in spec.split("|")]
