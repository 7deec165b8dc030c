"""Resolving `--model` to a file or directory on disk and loading model + tokenizer from it.

A model is the default GGUF, a GGUF file (or the first shard of a split one), a Hugging Face
directory, the seed's checkpoint file with a tokenizer directory, or a Hub reference that the model
store resolves to one of those in its cache.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from roseinfer.config import EngineConfig, ModelConfig
from roseinfer.errors import ModelLoadError
from roseinfer.heap import trim_heap
from roseinfer.models.default_model import DEFAULT_MODEL_NAME, default_model_path
from roseinfer.models.gguf_file import GGUFFile, split_shard_paths
from roseinfer.models.gguf_loader import gguf_weights, model_config_from_gguf
from roseinfer.models.hf_config import (
    VISION_ENCODER_PREFIXES,
    VISION_TEXT_PREFIX,
    model_config_from_hf,
)
from roseinfer.models.model_store import resolve_model
from roseinfer.models.registry import build_model
from roseinfer.models.seed_checkpoint import load_seed_checkpoint, seed_weights
from roseinfer.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

_CHECKPOINT_SUFFIXES = (".pt", ".pth", ".ckpt", ".bin")


@dataclass
class ModelSource:
    """Where a model is on disk and what kind of file it is; reads its parts on demand, so the
    front end can take the tokenizer and configuration without loading any weight."""

    kind: str  # "hf" | "gguf" | "checkpoint"
    path: Path
    tokenizer_dir: Path | None
    name: str  # what /v1/models shows by default
    _gguf: GGUFFile | None = field(default=None, repr=False, compare=False)

    @classmethod
    def resolve(cls, model: str | None, tokenizer: str | None = None) -> ModelSource:
        if model is None:
            path, name = default_model_path(), DEFAULT_MODEL_NAME
        else:
            # A path on disk as it is; a Hub reference (user/repo[:QUANT]) from the cache, pulled
            # the first time (models/model_store.py).
            path, name = resolve_model(model)
        tokenizer_dir = Path(tokenizer).expanduser() if tokenizer else None
        if tokenizer_dir is not None and not tokenizer_dir.is_dir():
            raise ModelLoadError(f"tokenizer directory {tokenizer!r} not found")
        if path.is_dir():
            if (path / "config.json").is_file():
                return cls("hf", path, tokenizer_dir, name)
            ggufs = _model_ggufs(path)
            if len(ggufs) != 1:
                raise ModelLoadError(
                    f"{path} is neither a Hugging Face model directory (no config.json) "
                    "nor a directory holding exactly one .gguf file"
                )
            path = ggufs[0]
        if _is_gguf(path):
            return cls("gguf", path, tokenizer_dir, name)
        if path.suffix.lower() in _CHECKPOINT_SUFFIXES:
            if tokenizer_dir is None:
                raise ModelLoadError(
                    f"{path} is a bare checkpoint: pass its tokenizer directory with "
                    "--tokenizer-name/--tokenizer (a directory with tokenizer.json or vocab.json + merges.txt)"
                )
            return cls("checkpoint", path, tokenizer_dir, name)
        raise ModelLoadError(
            f"{path}: unrecognised model file (expected .gguf, a Hugging Face directory, or a "
            f"{'/'.join(_CHECKPOINT_SUFFIXES)} checkpoint)"
        )

    def gguf(self) -> GGUFFile:
        """The GGUF file, its header parsed once per source (tokenizer, configuration and weights
        all read it)."""
        if self._gguf is None:
            self._gguf = GGUFFile(self.path)
        return self._gguf

    def tokenizer(self) -> Tokenizer:
        if self.tokenizer_dir is not None:
            return Tokenizer.from_pretrained_dir(self.tokenizer_dir)
        if self.kind == "hf":
            return Tokenizer.from_pretrained_dir(self.path)
        return Tokenizer.from_gguf_metadata(self.gguf().metadata)

    def model_config(self) -> ModelConfig:
        if self.kind == "hf":
            return model_config_from_hf(self.path)
        if self.kind == "gguf":
            return model_config_from_gguf(self.gguf())
        config, _ = load_seed_checkpoint(self.path)
        eos = self.tokenizer().eos_token_id
        config.eos_token_ids = [eos] if eos is not None else []
        return config

    def weights(self, config: ModelConfig) -> Iterator[tuple[str, object]]:
        """Named checkpoint tensors as stored: dense torch tensors, or GGUF `BlockTensor`s."""
        if self.kind == "hf":
            if config.vision is not None:
                return _text_weights(_safetensors_weights(self.path))
            return _safetensors_weights(self.path)
        if self.kind == "gguf":
            return gguf_weights(self.gguf(), config)
        _, state_dict = load_seed_checkpoint(self.path)
        return seed_weights(state_dict)


    def vision_weights(self) -> dict[str, torch.Tensor]:
        """A vision-language checkpoint's encoder weights, named as the encoder module names them."""
        return {name.removeprefix("model."): tensor for name, tensor in _safetensors_weights(self.path)
                if name.startswith(VISION_ENCODER_PREFIXES)}


def _text_weights(weights: Iterator[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """The text model's tensors of a vision-language checkpoint, named as a text checkpoint's."""
    for name, tensor in weights:
        if name.startswith(VISION_TEXT_PREFIX):
            yield "model." + name.removeprefix(VISION_TEXT_PREFIX), tensor
        elif not name.startswith(VISION_ENCODER_PREFIXES):
            yield name, tensor


@dataclass
class LoadedModel:
    model: nn.Module
    config: ModelConfig
    tokenizer: Tokenizer
    name: str  # what /v1/models shows by default


def _model_ggufs(directory: Path) -> list[Path]:
    """The directory's GGUF models: a split file's shards count once (as its first shard), a
    vision projector (mmproj*.gguf) is not a model."""
    found = []
    for path in sorted(directory.glob("*.gguf")):
        if path.name.lower().startswith("mmproj"):
            continue
        shards = split_shard_paths(path)
        if shards is not None and path != shards[0]:
            continue
        found.append(path)
    return found


def _is_gguf(path: Path) -> bool:
    if path.suffix.lower() == ".gguf":
        return True
    with path.open("rb") as handle:
        return handle.read(4) == b"GGUF"


def _safetensors_weights(directory: Path) -> Iterator[tuple[str, torch.Tensor]]:
    files = sorted(directory.glob("*.safetensors"))
    if files:
        for file in files:
            with safe_open(str(file), framework="pt") as handle:
                for name in handle.keys():  # noqa: SIM118 - safe_open is not a dict
                    yield name, handle.get_tensor(name)
        return
    bins = sorted(directory.glob("pytorch_model*.bin"))
    if not bins:
        raise ModelLoadError(f"{directory}: no *.safetensors (or pytorch_model*.bin) weights found")
    for file in bins:
        yield from torch.load(file, map_location="cpu", weights_only=True).items()


def load_vision_encoder(config: EngineConfig, model_config: ModelConfig) -> nn.Module:
    """A vision-language model's image encoder (models/vision), with its checkpoint's weights."""
    from roseinfer.models.vision import VISION_ENCODERS

    vision = model_config.vision
    encoder = VISION_ENCODERS[vision.family].from_hf_config(vision.hf_config)
    source = ModelSource.resolve(config.model, config.tokenizer)
    missing, unexpected = encoder.load_state_dict(source.vision_weights(), strict=False)
    if missing or unexpected:
        raise ModelLoadError(f"{source.path}: the image encoder's weights do not match its configuration "
                             f"(missing {missing[:3]}, unexpected {unexpected[:3]})")
    return encoder


def load_model_weights(config: EngineConfig, model_config: ModelConfig) -> nn.Module:
    """The model of `config.model` with its weights, on the configured device, dtype and kernels."""
    source = ModelSource.resolve(config.model, config.tokenizer)
    model = build_model(
        model_config, source.weights(model_config), config.torch_device, config.torch_dtype, config.quantization
    )
    del source
    release_free_memory()
    logger.info("weights: %s; resident now %s", describe_weights(model), _resident())
    return model


def describe_weights(model: nn.Module) -> str:
    """The model's weights by the type they are held in, e.g. "Q4_K 461.3 MB (97), Q6_K ... = 690.1 MB"
    (a weight two layers share is counted once)."""
    from roseinfer.layers.linear import BlockLinear
    from roseinfer.layers.parallel import VocabParallelEmbedding

    sizes: dict[str, list[int]] = {}
    seen: set[int] = set()

    def count(kind: str, tensor: torch.Tensor) -> None:
        if tensor is None or tensor.numel() == 0:
            return
        # oneDNN's prepacked weights (every float layer on AMX CPUs) are opaque: no storage, no
        # data pointer; each is its own weight.
        key = id(tensor) if tensor.is_mkldnn else tensor.data_ptr()
        if key in seen:
            return
        seen.add(key)
        entry = sizes.setdefault(kind, [0, 0])
        entry[0] += tensor.numel() * tensor.element_size()
        entry[1] += 1

    for module in model.modules():
        if isinstance(module, BlockLinear):
            for part in module.parts:
                count(part.qtype.name, part.packed)
        elif isinstance(module, VocabParallelEmbedding) and module.blocks is not None:
            count(module.blocks.qtype.name, module.blocks.packed)
        for tensor in [*module.parameters(recurse=False), *module.buffers(recurse=False)]:
            if not isinstance(module, BlockLinear):
                count(str(tensor.dtype).removeprefix("torch."), tensor)
    total = sum(size for size, _ in sizes.values())
    parts = ", ".join(f"{kind} {size / 1e6:.1f} MB ({n})" for kind, (size, n) in
                      sorted(sizes.items(), key=lambda item: -item[1][0]))
    return f"{parts} = {total / 1e6:.1f} MB"


def _resident() -> str:
    try:
        status = Path("/proc/self/status").read_text()
    except OSError:
        return "unknown"
    kib = next((int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:")), 0)
    return f"{kib / 1024:.0f} MiB"


def release_free_memory() -> None:
    """Give the heap pages that loading freed (file buffers, dequantized copies) back to the
    system: without it they stay in the process's resident memory (~0.2 GB for the default model)."""
    gc.collect()
    trim_heap()


def load_model(
    model: str | None,
    tokenizer: str | None,
    device: torch.device,
    dtype: torch.dtype,
    quantization: str = "auto",
) -> LoadedModel:
    """Model, configuration and tokenizer in one call (for tools that run the model directly)."""
    source = ModelSource.resolve(model, tokenizer)
    config = source.model_config()
    built = build_model(config, source.weights(config), device, dtype, quantization)
    return LoadedModel(built, config, source.tokenizer(), source.name)
