"""How a tensor-parallel model is cut: attention heads, MLP columns and the vocabulary, per rank.

Megatron's split, with one relaxation: heads go to ranks as evenly as they go, so a model whose KV
heads do not divide by the rank count (the default model has 3 KV heads) still runs on 2 ranks,
one rank holding one KV head more than the other (with the query heads that share it). A model
with fewer KV heads than ranks cannot be split without copying heads, and is refused.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from roseinfer.errors import InvalidRequestError

if TYPE_CHECKING:
    from roseinfer.config import ModelConfig


def partition(total: int, parts: int, index: int) -> tuple[int, int]:
    """(start, size) of part `index` when `total` units are split as evenly as they go: the first
    `total % parts` parts get one unit more."""
    base, extra = divmod(total, parts)
    start = index * base + min(index, extra)
    return start, base + (1 if index < extra else 0)


def padded_vocab_size(vocab_size: int, parts: int) -> int:
    """The vocabulary rounded up to a multiple of the rank count: every rank holds the same number
    of embedding and LM-head rows (the padding rows are zero and never looked up), so the logits
    of all ranks gather into one tensor."""
    return -(-vocab_size // parts) * parts


def check_tensor_parallel(model_config: ModelConfig, tensor_parallel_size: int) -> None:
    """Raise a clear error if the model cannot be split over this many ranks."""
    if tensor_parallel_size == 1:
        return
    moe = model_config.moe
    if moe is not None:  # every expert's FFN is cut as a dense MLP is (models/moe.py)
        for what, width in (("expert FFN width", moe.intermediate_size),
                            ("shared expert FFN width", moe.shared_expert_intermediate_size)):
            if width and width < tensor_parallel_size:
                raise InvalidRequestError(
                    f"tensor_parallel_size {tensor_parallel_size} is more than the {what} {width}",
                    "tensor_parallel_size",
                )
    kv_heads = model_config.num_kv_heads
    if kv_heads < tensor_parallel_size:
        raise InvalidRequestError(
            f"tensor_parallel_size {tensor_parallel_size} is more than the model's {kv_heads} KV head(s): "
            f"every rank must hold at least one KV head (use at most {kv_heads} ranks)",
            "tensor_parallel_size",
        )
    if model_config.num_heads % kv_heads:
        raise InvalidRequestError(
            f"the model's {model_config.num_heads} attention heads do not share its {kv_heads} KV heads "
            "evenly, so they cannot be split across ranks", "tensor_parallel_size",
        )
    if model_config.intermediate_size < tensor_parallel_size:
        raise InvalidRequestError(
            f"tensor_parallel_size {tensor_parallel_size} is more than the MLP width "
            f"{model_config.intermediate_size}", "tensor_parallel_size",
        )
