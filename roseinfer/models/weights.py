"""Copying named checkpoint tensors into a model's parameters, checking that nothing is missing.

A tensor in a block format (GGUF's quantized types) is not copied: its parts are kept and handed,
with the module, to `on_module_loaded` once the module is complete, which gives the module the
kernel for them (layers/linear.py)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from roseinfer.errors import ModelLoadError
from roseinfer.layers.quantization.gguf import BlockTensor

# (module name, its block parameters: parameter name -> [(first row, tensor)]) -> None
ModuleLoaded = Callable[[str, dict[str, list[tuple[int, BlockTensor]]]], None]


def _rows(param: torch.Tensor) -> int:
    return param.shape[0] if param.dim() else 1


class WeightLoader:
    """`on_module_loaded(module_name, blocks)`, if given, is called as soon as every parameter of a
    module is loaded (the module may then be converted, e.g. a linear layer quantized, while the rest
    loads), with the parts of its parameters that came in blocks; the loader lets go of that
    module's parameters then, so that a replaced weight is freed at once rather than at the end of
    the load."""

    def __init__(self, model: nn.Module, on_module_loaded: ModuleLoaded | None = None) -> None:
        self.params = dict(model.named_parameters(remove_duplicate=False))
        self._rows_loaded: dict[str, int] = {}
        self._on_module_loaded = on_module_loaded
        self._members: dict[str, list[str]] = {}  # module name -> its parameters
        for name in self.params:
            self._members.setdefault(_module_of(name), []).append(name)
        self._waiting = {module: set(names) for module, names in self._members.items()}  # not yet complete
        self._blocks: dict[str, list[tuple[int, BlockTensor]]] = {}  # parameter -> its parts in blocks

    def load(self, name: str, tensor: torch.Tensor | BlockTensor) -> None:
        param = self._param(name)
        if tuple(tensor.shape) != tuple(param.shape):
            raise ModelLoadError(
                f"tensor {name!r} has shape {tuple(tensor.shape)}, the model expects {tuple(param.shape)}"
            )
        if isinstance(tensor, BlockTensor):
            self._keep_blocks(name, 0, tensor)
        else:
            with torch.no_grad():
                param.copy_(tensor)
        self._set_rows(name, _rows(param))

    def _keep_blocks(self, name: str, first_row: int, tensor: BlockTensor) -> None:
        if self._on_module_loaded is None:
            raise ModelLoadError(f"tensor {name!r} is in {tensor.qtype.name} blocks, which this model cannot take")
        self._blocks.setdefault(name, []).append((first_row, tensor))

    def load_rows(self, name: str, tensor: torch.Tensor | BlockTensor, first_row: int) -> None:
        """Load one shard of a fused matrix (e.g. k_proj into qkv_proj) at its row offset."""
        param = self._param(name)
        end = first_row + tensor.shape[0]
        if end > param.shape[0] or tuple(tensor.shape[1:]) != tuple(param.shape[1:]):
            raise ModelLoadError(
                f"tensor for {name!r} rows {first_row}:{end} has shape {tuple(tensor.shape)}, "
                f"which does not fit {tuple(param.shape)}"
            )
        if isinstance(tensor, BlockTensor):
            self._keep_blocks(name, first_row, tensor)
        else:
            with torch.no_grad():
                param[first_row:end].copy_(tensor)
        self._set_rows(name, self._rows_loaded.get(name, 0) + tensor.shape[0])

    def mark_loaded(self, name: str) -> None:
        self._set_rows(name, _rows(self._param(name)))

    def _set_rows(self, name: str, rows: int) -> None:
        self._rows_loaded[name] = rows
        if rows != _rows(self.params[name]):
            return
        module = _module_of(name)
        waiting = self._waiting.get(module)
        if waiting is None:
            return
        waiting.discard(name)
        if not waiting and self._on_module_loaded is not None:
            del self._waiting[module]
            blocks = {}
            for done in self._members[module]:
                del self.params[done]  # complete: nothing left to check, and the module may drop it
                if done in self._blocks:
                    blocks[done.rpartition(".")[2]] = self._blocks.pop(done)
            self._on_module_loaded(module, blocks)

    def was_loaded(self, name: str) -> bool:
        return name in self._rows_loaded

    def check_complete(self) -> None:
        missing = [
            name
            for name, param in self.params.items()
            if self._rows_loaded.get(name, 0) != _rows(param)
        ]
        if missing:
            shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
            raise ModelLoadError(f"the checkpoint lacks {len(missing)} tensor(s): {shown}")

    def _param(self, name: str) -> torch.nn.Parameter:
        if name not in self.params and name in self._rows_loaded:
            raise ModelLoadError(f"the checkpoint has tensor {name!r} twice")
        param = self.params.get(name)
        if param is None:
            raise ModelLoadError(f"the checkpoint has a tensor {name!r} that the model does not use")
        return param


def dense(tensor: torch.Tensor | BlockTensor) -> torch.Tensor:
    """A tensor's values, dequantized to float32 where they came in blocks (a small parameter a
    model reshapes or computes with at load: a conv kernel, decay rates, norms)."""
    return tensor.dequantize(torch.float32) if isinstance(tensor, BlockTensor) else tensor


def _module_of(param_name: str) -> str:
    return param_name.rpartition(".")[0]
