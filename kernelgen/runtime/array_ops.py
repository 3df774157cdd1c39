"""The few array operations the metadata checks run where the metadata lives (``validate=True``
on device arrays; host arrays always), in NumPy's spelling, for NumPy, CuPy or torch arrays.

Each check computes its flags with the arrays' own library and reads back only what it must:
one small array of first-bad indices per check set (one synchronisation on a device).
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

from kernelgen.runtime.frameworks import module_of

__all__ = ["ArrayOps"]


class ArrayOps:
    """Array operations of the library of ``like`` (an array of it, on the device to use)."""

    def __init__(self, like: Any) -> None:
        self.library = module_of(like)
        self.like = like
        if self.library == "torch":
            self.xp = sys.modules["torch"]
        elif self.library == "cupy":
            self.xp = sys.modules["cupy"]
        else:
            self.xp = np

    def int64(self, values: Any) -> Any:
        """``values`` (host or of this library) as an int64 array of this library."""
        if self.library == "torch":
            torch = self.xp
            if not isinstance(values, torch.Tensor):
                values = torch.as_tensor(np.asarray(values))
            return values.to(device=self.like.device, dtype=torch.int64)
        return self.xp.asarray(values).astype(self.xp.int64)

    def empty(self, shape: tuple[int, ...], dtype: str) -> Any:
        """Uninitialised memory of ``dtype`` (a NumPy name, e.g. "uint8") on the device."""
        if self.library == "torch":
            return self.xp.empty(shape, dtype=getattr(self.xp, dtype), device=self.like.device)
        return self.xp.empty(shape, dtype=dtype)

    def index(self, values: np.ndarray) -> Any:
        """Host integers as an index array of this library, on its device (a small upload)."""
        if self.library == "torch":
            return self.xp.as_tensor(values, device=self.like.device)
        return self.xp.asarray(values)

    def float32_contiguous(self, values: Any) -> Any:
        """``values`` (of this library) as a contiguous float32 array (no copy if it is one)."""
        if self.library == "torch":
            return values.detach().to(self.xp.float32).contiguous()
        return self.xp.ascontiguousarray(values, dtype=self.xp.float32)

    def arange(self, n: int) -> Any:
        """0 .. n - 1 as int64, on the library's device."""
        if self.library == "torch":
            return self.xp.arange(n, device=self.like.device)
        return self.xp.arange(n, dtype=self.xp.int64)

    def zeros_bool(self, shape: tuple[int, ...]) -> Any:
        if self.library == "torch":
            return self.xp.zeros(shape, dtype=self.xp.bool, device=self.like.device)
        return self.xp.zeros(shape, dtype=bool)

    def sort_rows(self, values: Any) -> Any:
        """``values`` sorted along its last axis."""
        if self.library == "torch":
            return self.xp.sort(values, dim=-1).values
        return self.xp.sort(values, axis=-1)

    def first_true(self, mask: Any) -> int:
        """Flat index of the first True of ``mask``, or -1 (one read back to the host)."""
        return self.first_true_each([mask])[0]

    def first_true_each(self, masks: list[Any]) -> list[int]:
        """For each of ``masks``, the flat index of its first True or -1, read back together
        (one synchronisation)."""
        found = []
        for mask in masks:
            flat = self._int32(mask.reshape(-1))
            if (flat.numel() if self.library == "torch" else flat.size) == 0:
                found.append(None)
            else:
                found.append((flat.max(), self._int32(flat.argmax())))
        pairs = [x for pair in found if pair is not None for x in pair]
        values = iter(self.host(self.xp.stack(pairs)).tolist() if pairs else [])
        result = []
        for pair in found:
            any_true, index = (0, -1) if pair is None else (next(values), next(values))
            result.append(int(index) if any_true else -1)
        return result

    def _int32(self, values: Any) -> Any:
        if self.library == "torch":
            return values.to(self.xp.int32)
        return values.astype(self.xp.int32)

    def host(self, values: Any) -> np.ndarray:
        """``values`` read back as a NumPy array."""
        if self.library == "torch":
            return values.detach().cpu().numpy()
        return values.get() if self.library == "cupy" else np.asarray(values)
