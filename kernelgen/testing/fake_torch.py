"""A host-only stand-in for the slice of torch that ``kernelgen.attention`` touches with CUDA
tensors: shape, ``stride()``, dtype, ``data_ptr()``, ``get_device()``, ``to`` and ``expand``;
``torch.empty``; ``torch.cuda.current_stream(device).cuda_stream``. Tensors hold no data and
nothing is computed. Every allocation is logged in :data:`ALLOCATED` (pointer -> tensor) and
each device's current stream is :data:`STREAMS` [device], so tests can see what a call
allocated and where it launched. ``module(backed=True)`` backs tensors with host memory
(``Tensor.host``; :data:`HOST` maps each pointer to it) for the CPU emulator. Used with
kernelgen/testing/fake_cupy (which kernelgen still compiles and launches through).
"""

from __future__ import annotations

import itertools
import sys
import types
from typing import Any

import numpy as np

from kernelgen.testing.fake_cupy import poisoned_host

_POINTERS = itertools.count(1 << 32, 1 << 12)  # 4 KiB apart: 16-byte aligned
ALLOCATED: dict[int, Tensor] = {}
STREAMS: dict[int, int] = {}  # device -> current stream pointer (0: the default stream)
HOST: dict[int, np.ndarray] = {}  # pointer -> host memory of backed tensors
BACKED = {"on": False}  # whether empty() allocates host memory


class dtype:  # noqa: N801 (torch's spelling)
    def __init__(self, name: str, itemsize: int) -> None:
        self.name, self.itemsize = name, itemsize

    def __repr__(self) -> str:
        return f"torch.{self.name}"

    __str__ = __repr__


float16 = dtype("float16", 2)
bfloat16 = dtype("bfloat16", 2)
float32 = dtype("float32", 4)
int32 = dtype("int32", 4)
_NUMPY = {"float16": np.float16, "bfloat16": np.uint16, "float32": np.float32, "int32": np.int32}
_TORCH = {np.dtype(v).name: globals()[k] for k, v in _NUMPY.items() if k != "bfloat16"}


class device:  # noqa: N801
    def __init__(self, kind: str, index: int | None = None) -> None:
        self.type, self.index = kind, index

    def __repr__(self) -> str:
        return self.type if self.index is None else f"{self.type}:{self.index}"


class Tensor:
    """Shape, strides (elements), dtype, a made-up pointer and a device (-1: the CPU)."""

    def __init__(
        self,
        shape: tuple[int, ...],
        dtype: dtype,
        device_index: int = 0,
        strides: tuple[int, ...] | None = None,
        offset: int = 0,
        host: np.ndarray | None = None,
    ) -> None:
        self.host = host
        if host is not None:
            shape, strides = host.shape, tuple(s // host.itemsize for s in host.strides)
        self.shape = tuple(shape)
        self.dtype = dtype
        if strides is None:
            strides, running = (), 1
            for size in reversed(self.shape):
                strides = (running, *strides)
                running *= size
        self._strides = tuple(strides)
        self._device_index = device_index
        if host is None:
            self._ptr = next(_POINTERS) + offset
        else:
            self._ptr = host.__array_interface__["data"][0]
            HOST.setdefault(self._ptr, host)
        self.is_cuda = device_index >= 0
        self.device = device("cuda", device_index) if self.is_cuda else device("cpu")
        ALLOCATED[self._ptr] = self

    def stride(self) -> tuple[int, ...]:
        return self._strides

    def data_ptr(self) -> int:
        return self._ptr

    def get_device(self) -> int:
        return self._device_index

    def to(self, dtype: dtype) -> Tensor:
        if self.host is not None:
            return from_numpy(self.host.astype(_NUMPY[dtype.name]), self._device_index)
        return Tensor(self.shape, dtype, self._device_index)

    def expand(self, shape: tuple[int, ...]) -> Tensor:
        """A broadcast view: stride 0 along new and size-1 dimensions."""
        lead = len(shape) - len(self.shape)
        strides = tuple(
            0 if i < lead or self.shape[i - lead] == 1 else self._strides[i - lead]
            for i in range(len(shape))
        )
        view = Tensor.__new__(Tensor)
        view.__dict__.update(self.__dict__, shape=tuple(shape), _strides=strides)
        if self.host is not None:
            view.host = np.broadcast_to(self.host, shape)
        return view


def from_numpy(host: np.ndarray, device_index: int = 0) -> Tensor:
    """A backed CUDA tensor over ``host`` (not copied; uint16 holds bfloat16 bits)."""
    kind = bfloat16 if host.dtype == np.uint16 else _TORCH[host.dtype.name]
    return Tensor((), kind, device_index, host=host)


Tensor.__module__ = "torch"  # kernelgen recognises torch tensors by module


def empty(shape: tuple[int, ...], dtype: dtype, device: device) -> Tensor:
    index = device.index if device.index is not None else 0
    if BACKED["on"]:
        return from_numpy(poisoned_host(shape, _NUMPY[dtype.name]), index)
    return Tensor(shape, dtype, index)


def module(backed: bool = False) -> types.ModuleType:
    """A fresh ``torch`` module object (empty allocation log, default streams; host memory
    behind every tensor with ``backed``)."""
    ALLOCATED.clear()
    STREAMS.clear()
    HOST.clear()
    BACKED["on"] = backed
    torch = types.ModuleType("torch")
    torch.__version__ = "0.0.0-fake"
    torch.Tensor = Tensor
    for name in ("float16", "bfloat16", "float32", "int32", "dtype", "device", "empty"):
        setattr(torch, name, getattr(sys.modules[__name__], name))

    def current_stream(index: int | None = None) -> Any:
        return types.SimpleNamespace(cuda_stream=STREAMS.get(index or 0, 0))

    torch.cuda = types.SimpleNamespace(current_stream=current_stream)
    return torch
