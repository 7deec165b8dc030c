"""Copying named checkpoint tensors into a model's parameters, checking that nothing is missing."""

from __future__ import annotations

import torch
from torch import nn

from roseinfer.errors import ModelLoadError


class WeightLoader:
    def __init__(self, model: nn.Module) -> None:
        self.params = dict(model.named_parameters(remove_duplicate=False))
        self._rows_loaded: dict[str, int] = {}

    def load(self, name: str, tensor: torch.Tensor) -> None:
        param = self._param(name)
        if tuple(tensor.shape) != tuple(param.shape):
            raise ModelLoadError(
                f"tensor {name!r} has shape {tuple(tensor.shape)}, the model expects {tuple(param.shape)}"
            )
        with torch.no_grad():
            param.copy_(tensor)
        self._rows_loaded[name] = param.shape[0] if param.dim() else 1

    def load_rows(self, name: str, tensor: torch.Tensor, first_row: int) -> None:
        """Load one shard of a fused matrix (e.g. k_proj into qkv_proj) at its row offset."""
        param = self._param(name)
        end = first_row + tensor.shape[0]
        if end > param.shape[0] or tuple(tensor.shape[1:]) != tuple(param.shape[1:]):
            raise ModelLoadError(
                f"tensor for {name!r} rows {first_row}:{end} has shape {tuple(tensor.shape)}, "
                f"which does not fit {tuple(param.shape)}"
            )
        with torch.no_grad():
            param[first_row:end].copy_(tensor)
        self._rows_loaded[name] = self._rows_loaded.get(name, 0) + tensor.shape[0]

    def mark_loaded(self, name: str) -> None:
        param = self._param(name)
        self._rows_loaded[name] = param.shape[0] if param.dim() else 1

    def was_loaded(self, name: str) -> bool:
        return name in self._rows_loaded

    def check_complete(self) -> None:
        missing = [
            name
            for name, param in self.params.items()
            if self._rows_loaded.get(name, 0) != (param.shape[0] if param.dim() else 1)
        ]
        if missing:
            shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
            raise ModelLoadError(f"the checkpoint lacks {len(missing)} tensor(s): {shown}")

    def _param(self, name: str) -> torch.nn.Parameter:
        param = self.params.get(name)
        if param is None:
            raise ModelLoadError(f"the checkpoint has a tensor {name!r} that the model does not use")
        return param
