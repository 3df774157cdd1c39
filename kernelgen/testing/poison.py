"""NaN-poisoned allocations for correctness checks: whatever attention() allocates (out, lse,
scratch) in either library starts as NaN (integer buffers as -1), so that elements a kernel
leaves unwritten show up instead of a recycled block's old (often correct) values."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import numpy as np

from kernelgen.runtime.frameworks import CupyArrays, TorchArrays
from kernelgen.runtime.launch import import_cupy
from kernelgen.tuning.gpu import nan_fill

# Integer buffers (block-mask counts and indices) get all bits set: -1 is no count or index a
# builder writes, so an element left unwritten still shows.
INTEGER_POISON = -1


def _nan_cupy(array: Any) -> Any:
    cupy = import_cupy()
    if np.issubdtype(array.dtype, np.integer):
        array.fill(INTEGER_POISON)
        return array
    return nan_fill(cupy, array)


def _nan_torch(tensor: Any) -> Any:
    return tensor.fill_(float("nan") if tensor.is_floating_point() else INTEGER_POISON)


@contextlib.contextmanager
def poisoned_outputs() -> Iterator[None]:
    """Within the block, ``CupyArrays.empty`` and ``TorchArrays.empty`` (the only allocators of
    attention()'s outputs and scratch) return NaN-filled memory."""
    originals = {holder: holder.__dict__["empty"] for holder in (CupyArrays, TorchArrays)}

    def poisoned(holder: Any, fill: Any) -> staticmethod:
        empty = originals[holder].__func__
        return staticmethod(lambda shape, dtype, device: fill(empty(shape, dtype, device)))

    CupyArrays.empty = poisoned(CupyArrays, _nan_cupy)
    TorchArrays.empty = poisoned(TorchArrays, _nan_torch)
    try:
        yield
    finally:
        for holder, empty in originals.items():
            holder.empty = empty
