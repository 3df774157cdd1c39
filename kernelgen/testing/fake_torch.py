"""A host-only stand-in for the slice of torch that ``kernelgen.attention`` touches with CUDA
tensors: shape, ``stride()``, dtype, ``data_ptr()``, ``get_device()``, ``to``, ``expand``,
``fill_``, and for fp8 calls ``view(dtype)``, ``swapaxes``/``transpose``, ``detach``,
``contiguous`` and indexed writes; ``torch.empty``, ``torch.as_tensor``;
``torch.cuda.current_stream(device)`` (``cuda_stream`` and the CUDA
stream protocol); ``torch.cuda.graph`` capture. Tensors hold no data and nothing is computed.
Like torch's caching allocator, a tensor's block is free the moment the tensor is gone and the
next allocation that fits takes it at once. Live tensors are :data:`ALLOCATED` (pointer ->
tensor), every allocation is logged in :data:`LOG`, and each device's current stream is
:data:`STREAMS` [device], so tests can see what a call allocated and where it launched.
``module(backed=True)`` backs tensors with host memory (``Tensor.host``; :data:`HOST` maps each
pointer to it) for the CPU emulator. Used with kernelgen/testing/fake_cupy (which kernelgen
still compiles and launches through)."""

from __future__ import annotations

import contextlib
import itertools
import sys
import types
import weakref
from collections.abc import Iterator
from typing import Any, NamedTuple

import numpy as np

from kernelgen.testing.fake_cupy import CAPTURING, poisoned_host
from kernelgen.tuning.gpu import bfloat16_bits

_POINTERS = itertools.count(1 << 32, 1 << 12)  # 4 KiB apart: 16-byte aligned
ALLOCATED: weakref.WeakValueDictionary[int, Tensor] = weakref.WeakValueDictionary()


class Allocation(NamedTuple):
    ptr: int
    nbytes: int
    dtype: dtype
    shape: tuple[int, ...]


LOG: list[Allocation] = []  # every allocation, in order
FREE: list[tuple[int, int]] = []  # free blocks (pointer, bytes), most recently freed last
FILLED: set[int] = set()  # pointers of tensors that fill_() wrote (e.g. a NaN poison)
STREAMS: dict[int, int] = {}  # device -> current stream pointer (0: the default stream)
HOST: dict[int, np.ndarray] = {}  # pointer -> host memory of backed tensors
WRITES: list[tuple[int, Any]] = []  # indexed writes (__setitem__): (pointer, index)
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
int64 = dtype("int64", 8)
uint8 = dtype("uint8", 1)
float8_e4m3fn = dtype("float8_e4m3fn", 1)  # held as its uint8 bit patterns
_NUMPY = {"float16": np.float16, "bfloat16": np.uint16, "float32": np.float32, "int32": np.int32,
          "int64": np.int64, "uint8": np.uint8, "float8_e4m3fn": np.uint8}  # fmt: skip
_BITS = ("bfloat16", "float8_e4m3fn")  # held as the bits of another NumPy type
_TORCH = {np.dtype(v).name: globals()[k] for k, v in _NUMPY.items() if k not in _BITS}


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
            nbytes = max(1, int(np.prod(self.shape))) * dtype.itemsize
            self._ptr = _allocate(nbytes) + offset
            weakref.finalize(self, FREE.append, (self._ptr - offset, nbytes))
            LOG.append(Allocation(self._ptr, nbytes, dtype, self.shape))
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
        """A converted copy: values, not bit patterns (bfloat16 is held as its uint16 bits);
        the tensor itself when it has ``dtype`` already (as torch returns it)."""
        if dtype is self.dtype:
            return self
        if self.host is None:
            return Tensor(self.shape, dtype, self._device_index)
        values = self.host
        if self.dtype is bfloat16:
            values = (values.astype(np.uint32) << np.uint32(16)).view(np.float32)
        if dtype is bfloat16:
            return from_numpy(bfloat16_bits(np, np.ascontiguousarray(values)), self._device_index)
        return from_numpy(values.astype(_NUMPY[dtype.name]), self._device_index)

    def detach(self) -> Tensor:
        return self

    def is_contiguous(self) -> bool:
        running = 1
        for size, stride in zip(reversed(self.shape), reversed(self._strides), strict=True):
            if size != 1 and stride != running:
                return False
            running *= size
        return True

    def contiguous(self) -> Tensor:
        """Itself when contiguous, else a contiguous copy (of the host values, when backed)."""
        if self.is_contiguous():
            return self
        if self.host is None:
            return Tensor(self.shape, self.dtype, self._device_index)
        copy = from_numpy(np.ascontiguousarray(self.host), self._device_index)
        copy.dtype = self.dtype
        return copy

    def view(self, kind: dtype) -> Tensor:
        """The same memory as another dtype of the same size (``Tensor.view(dtype)``)."""
        if kind.itemsize != self.dtype.itemsize:
            raise RuntimeError("the fake views only between dtypes of one size")
        return self._view(self.shape, self._strides, dtype=kind)

    def swapaxes(self, first: int, second: int) -> Tensor:
        """A strided view with two dimensions swapped (``transpose(first, second)``)."""
        order = list(range(len(self.shape)))
        order[first], order[second] = second, first
        shape = tuple(self.shape[i] for i in order)
        strides = tuple(self._strides[i] for i in order)
        view = self._view(shape, strides)
        if self.host is not None:
            view.host = self.host.swapaxes(first, second)
        return view

    transpose = swapaxes

    def _view(self, shape: tuple[int, ...], strides: tuple[int, ...], **fields: Any) -> Tensor:
        view = Tensor.__new__(Tensor)
        view.__dict__.update(self.__dict__, shape=shape, _strides=strides, _base=self, **fields)
        return view

    def __setitem__(self, index: Any, value: Any) -> None:
        """An indexed write (``index_put_``): logged in :data:`WRITES` (pointer, index); backed
        tensors write their host memory (index tensors by their host values)."""
        WRITES.append((self._ptr, index))
        if self.host is not None:
            if isinstance(index, tuple):
                index = tuple(i.host if isinstance(i, Tensor) else i for i in index)
            self.host[index] = value.host if isinstance(value, Tensor) else value

    def is_floating_point(self) -> bool:
        return self.dtype.name in ("float16", "bfloat16", "float32", "float64")

    def fill_(self, value: float) -> Tensor:
        """Every element set to ``value`` (a float; bfloat16 through its bits)."""
        FILLED.add(self._ptr)
        if self.host is not None:
            if self.dtype is bfloat16:
                value = bfloat16_bits(np, np.full(1, value, np.float32))[0]
            self.host[...] = value
        return self

    def expand(self, shape: tuple[int, ...]) -> Tensor:
        """A broadcast view: stride 0 along new and size-1 dimensions."""
        lead = len(shape) - len(self.shape)
        strides = tuple(
            0 if i < lead or self.shape[i - lead] == 1 else self._strides[i - lead]
            for i in range(len(shape))
        )
        view = Tensor.__new__(Tensor)
        view.__dict__.update(self.__dict__, shape=tuple(shape), _strides=strides, _base=self)
        if self.host is not None:
            view.host = np.broadcast_to(self.host, shape)
        return view


def as_tensor(values: Any, device: device | None = None) -> Tensor:
    """``torch.as_tensor``: host values as a tensor on ``device`` (backed by a copy of them)."""
    index = -1 if device is None or device.type == "cpu" else (device.index or 0)
    return from_numpy(np.array(values), index)


def from_numpy(host: np.ndarray, device_index: int = 0) -> Tensor:
    """A backed CUDA tensor over ``host`` (not copied; uint16 holds bfloat16 bits)."""
    kind = bfloat16 if host.dtype == np.uint16 else _TORCH[host.dtype.name]
    return Tensor((), kind, device_index, host=host)


Tensor.__module__ = "torch"  # kernelgen recognises torch tensors by module


def _allocate(nbytes: int) -> int:
    """A pointer to ``nbytes``: the start of the most recently freed block that holds them (the
    rest of it stays free), else fresh memory."""
    for index in range(len(FREE) - 1, -1, -1):
        ptr, size = FREE[index]
        if size >= nbytes:
            rest = -(-nbytes // 512) * 512  # torch rounds blocks to 512 bytes
            if size > rest:
                FREE[index] = (ptr + rest, size - rest)
            else:
                del FREE[index]
            return ptr
    return next(_POINTERS) if nbytes <= 1 << 12 else _fresh(nbytes)


def _fresh(nbytes: int) -> int:
    """Fresh memory of more than one 4 KiB step of the pointer counter."""
    ptr = next(_POINTERS)
    for _ in range(nbytes >> 12):
        next(_POINTERS)
    return ptr


def empty(shape: tuple[int, ...], dtype: dtype, device: device) -> Tensor:
    index = device.index if device.index is not None else 0
    if BACKED["on"]:
        tensor = from_numpy(poisoned_host(shape, _NUMPY[dtype.name]), index)
        tensor.dtype = dtype  # float8_e4m3fn: held as uint8
        return tensor
    return Tensor(shape, dtype, index)


class Stream:
    """``torch.cuda.Stream``: its pointer, device and the CUDA stream protocol."""

    def __init__(self, ptr: int, index: int) -> None:
        self.cuda_stream, self.device = ptr, device("cuda", index)

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, self.cuda_stream)


def current_stream(index: int | None = None) -> Stream:
    return Stream(STREAMS.get(index or 0, 0), index or 0)


class CUDAGraph:
    """``torch.cuda.CUDAGraph`` (nothing is recorded)."""


_CAPTURE_STREAMS = itertools.count(0xCA000, 0x100)


@contextlib.contextmanager
def graph(cuda_graph: CUDAGraph, pool: Any = None, stream: Any = None) -> Iterator[None]:
    """``torch.cuda.graph``: device 0's current stream is a side stream that captures."""
    previous = STREAMS.get(0, 0)
    STREAMS[0] = ptr = stream.cuda_stream if stream is not None else next(_CAPTURE_STREAMS)
    CAPTURING.add(ptr)
    try:
        yield
    finally:
        CAPTURING.discard(ptr)
        STREAMS[0] = previous


def module(backed: bool = False) -> types.ModuleType:
    """A fresh ``torch`` module object (empty allocation log, default streams; host memory
    behind every tensor with ``backed``)."""
    ALLOCATED.clear()
    LOG.clear()
    FREE.clear()
    FILLED.clear()
    STREAMS.clear()
    HOST.clear()
    WRITES.clear()
    BACKED["on"] = backed
    torch = types.ModuleType("torch")
    torch.__version__ = "0.0.0-fake"
    torch.Tensor = Tensor
    names = ("float16", "bfloat16", "float32", "int32", "int64", "uint8", "float8_e4m3fn",
             "dtype", "device", "empty", "as_tensor")  # fmt: skip
    for name in names:
        setattr(torch, name, getattr(sys.modules[__name__], name))

    torch.cuda = types.SimpleNamespace(
        current_stream=current_stream,
        graph=graph,
        CUDAGraph=CUDAGraph,
        is_current_stream_capturing=lambda: STREAMS.get(0, 0) in CAPTURING,
    )
    return torch
