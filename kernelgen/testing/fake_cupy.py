"""A host-only stand-in for the slice of CuPy that ``kernelgen.attention`` touches.

Arrays carry a shape, byte strides, a dtype, a made-up device pointer and the device they were
made on; ``empty`` allocates nothing but is counted by the default memory pool
(``get_default_memory_pool()``: bytes in use, freed blocks kept until ``free_all_blocks``); every
"device" is an sm_90 with 132 SMs. The current device and stream (``Device`` and stream
contexts: ``Stream.from_external``, and the deprecated ``ExternalStream``, which warns as CuPy 14
does) are kept in :data:`CURRENT` so that tests can see where a launch went; streams that
capture a CUDA graph are in :data:`CAPTURING`. ``module(backed=True)`` backs arrays with host memory
(``ndarray.host``; :data:`HOST` maps each pointer to it), so that the CPU emulator can run the
kernels that kernelgen launches. Kernel functions are whatever the caller puts
into ``RuntimeKernel.functions`` (see :func:`install`). It exists to measure and test the host
side of a call (checks, tuner lookup, argument packing) where there is no GPU; it computes
nothing.
"""

from __future__ import annotations

import itertools
import sys
import types
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np

_POINTERS = itertools.count(1 << 20, 1 << 12)  # 4 KiB apart: 16-byte aligned
CURRENT = {"device": 0, "stream": 0}  # the current device index and stream pointer
HOST: dict[int, np.ndarray] = {}  # pointer -> host memory of backed arrays
BACKED = {"on": False}  # whether empty() and asarray() allocate host memory
CAPTURING: set[int] = set()  # stream pointers capturing a CUDA graph (shared with fake_torch)


class MemoryPool:
    """CuPy's default memory pool as far as its accounting goes: an array's bytes are in use
    while it lives, then cached as a free block until ``free_all_blocks``."""

    def __init__(self) -> None:
        self.used, self.free = 0, 0

    def allocated(self, array: ndarray, nbytes: int) -> ndarray:
        self.used += nbytes
        weakref.finalize(array, self._freed, nbytes)
        return array

    def _freed(self, nbytes: int) -> None:
        self.used -= nbytes
        self.free += nbytes

    def used_bytes(self) -> int:
        return self.used

    def total_bytes(self) -> int:
        return self.used + self.free

    def free_all_blocks(self, stream: object = None) -> None:
        self.free = 0


POOL = MemoryPool()


class _Memory:
    def __init__(self, ptr: int) -> None:
        self.ptr = ptr


class ndarray:  # noqa: N801 (CuPy's spelling)
    """Shape, strides (bytes), dtype and a pointer; data only when backed by ``host``."""

    def __init__(
        self,
        shape: tuple[int, ...],
        dtype: Any,
        strides: Any = None,
        offset: int = 0,
        device: int | None = None,
        host: np.ndarray | None = None,
    ):
        self.host = host
        if host is not None:
            shape, dtype, strides = host.shape, host.dtype, host.strides
        self.shape = tuple(shape)
        self.dtype = np.dtype(dtype)
        self.ndim = len(self.shape)
        if strides is None:
            strides, running = [], self.dtype.itemsize
            for size in reversed(self.shape):
                strides.insert(0, running)
                running *= size
        self.strides = tuple(strides)
        if host is None:
            self.data = _Memory(next(_POINTERS) + offset)
        else:
            self.data = _Memory(host.__array_interface__["data"][0])
            HOST.setdefault(self.data.ptr, host)
        self._device_index = CURRENT["device"] if device is None else device

    @property
    def device(self) -> _Device:
        return _Device(self._device_index)

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape)) * self.dtype.itemsize

    def astype(self, dtype: Any) -> ndarray:
        if self.host is not None:
            return ndarray((), dtype, host=self.host.astype(dtype))
        return _pooled(ndarray(self.shape, dtype))

    def view(self, dtype: Any) -> ndarray:
        """The same memory as ``dtype`` elements (same itemsize only)."""
        if self.host is not None:
            return from_host(self.host.view(dtype), self._device_index)
        view = ndarray(self.shape, dtype, self.strides, device=self._device_index)
        view.data = self.data
        return view

    def fill(self, value: Any) -> None:
        FILLED.add(self.data.ptr)
        if self.host is not None:
            self.host.fill(value)


FILLED: set[int] = set()  # pointers of arrays that fill() wrote (e.g. a NaN poison)


def _pooled(array: ndarray) -> ndarray:
    """``array``, its bytes counted by the default memory pool while it lives."""
    return POOL.allocated(array, array.nbytes)


def from_host(host: np.ndarray, device: int | None = None) -> ndarray:
    """A backed array over ``host`` (not copied: strided views keep their strides)."""
    return ndarray((), host.dtype, device=device, host=host)


def poisoned_host(shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    """Host memory for a backed allocation until written: NaN for floating types, every bit set
    otherwise (-1 for signed integers; a NaN for bfloat16, as ml_dtypes' type or as the uint16
    bits fake_torch keeps)."""
    dtype = np.dtype(dtype)
    if dtype.kind == "f":
        return np.full(shape, np.nan, dtype)
    host = np.empty(shape, dtype)
    host.reshape(-1).view(np.uint8).fill(0xFF)
    return host


def broadcast_to(array: ndarray, shape: tuple[int, ...]) -> ndarray:
    if array.host is not None:
        return from_host(np.broadcast_to(array.host, shape), array._device_index)
    return array


def asarray(host: Any) -> ndarray:
    if BACKED["on"]:
        return _pooled(from_host(np.array(host)))
    return _pooled(ndarray(np.shape(host), np.asarray(host).dtype))


ndarray.__module__ = "cupy"  # kernelgen.calls.attention.describe recognises CuPy arrays by module


def empty(shape: Any, dtype: Any = np.float32) -> ndarray:
    shape = shape if isinstance(shape, tuple) else (shape,)
    if BACKED["on"]:
        return _pooled(from_host(poisoned_host(shape, dtype)))
    return _pooled(ndarray(shape, dtype))


class _MakesCurrent:
    """A context that makes ``self.current`` the value of CURRENT[slot] (restored on exit)."""

    slot = ""
    current: int

    def __enter__(self) -> _MakesCurrent:
        self.__dict__.setdefault("_saved", []).append(CURRENT[self.slot])
        CURRENT[self.slot] = self.current
        return self

    def __exit__(self, *exc: object) -> None:
        CURRENT[self.slot] = self.__dict__["_saved"].pop()


# Every fake device's compute capability ("90": an H100, whose untuned prefill runs the wgmma
# kernels; tests of the pointer kernels' plumbing set "80").
COMPUTE_CAPABILITY = "90"


class _Device(_MakesCurrent):
    """``cupy.cuda.Device``: a device, and a context that makes it current."""

    slot = "device"

    def __init__(self, index: int | None = None) -> None:
        self.id = self.current = CURRENT["device"] if index is None else index
        self.compute_capability = COMPUTE_CAPABILITY
        self.attributes = {"MultiProcessorCount": 132, "MaxSharedMemoryPerBlockOptin": 232448}


class Stream(_MakesCurrent):
    """``cupy.cuda.Stream`` as far as kernelgen uses it: ``from_external`` (CuPy 14.2: the
    device is unknown, -1, unless set), a context that makes the stream current after CuPy's
    device check, and ``is_capturing``."""

    slot = "stream"
    null: Stream

    def __init__(self, ptr: int = 0, device_id: int = -1) -> None:
        self.ptr = self.current = ptr
        self.device_id = device_id

    @classmethod
    def from_external(cls, obj: Any) -> Stream:
        """A stream from an object with ``__cuda_stream__() -> (0, pointer)``."""
        try:
            version, ptr = obj.__cuda_stream__()
        except AttributeError:
            raise TypeError(
                f"Object of type {type(obj).__name__} does not implement the CUDA stream "
                "protocol (__cuda_stream__ method)"
            ) from None
        if version != 0:
            raise TypeError(f"__cuda_stream__() returned unsupported version {version}")
        stream = cls(ptr)
        stream._foreign_stream_ref = obj
        return stream

    def __enter__(self) -> Stream:
        if self.device_id not in (-1, CURRENT["device"]):  # CuPy's check_stream_device_match
            raise RuntimeError(
                f"The device that the stream is created on ({self.device_id}) does not match "
                f"with the current device ({CURRENT['device']})"
            )
        super().__enter__()
        return self

    def is_capturing(self) -> bool:
        return self.ptr in CAPTURING


Stream.null = Stream(0)


class ExternalStream(Stream):
    """``cupy.cuda.ExternalStream``: deprecated since CuPy 14.0, and warns so."""

    def __init__(self, ptr: int, device_id: int = -1) -> None:
        warnings.warn(
            "ExternalStream is deprecated. Use Stream.from_external() instead to interoperate "
            "with external streams that implement the CUDA stream protocol.",
            DeprecationWarning,
            stacklevel=2,
        )
        super().__init__(ptr, device_id)


def get_current_stream() -> Stream:
    return Stream(CURRENT["stream"])


class CUDARuntimeError(RuntimeError):
    pass


def _properties(index: int) -> dict[str, Any]:
    major, minor = int(COMPUTE_CAPABILITY[:-1]), int(COMPUTE_CAPABILITY[-1])
    return {
        "name": f"Fake sm_{COMPUTE_CAPABILITY}".encode(),
        "major": major,
        "minor": minor,
        "multiProcessorCount": 132,
        "l2CacheSize": 50 << 20,
    }


def module(backed: bool = False) -> types.ModuleType:
    """A fresh ``cupy`` module object (device 0 and the null stream current; host memory
    behind every array with ``backed``)."""
    CURRENT.update(device=0, stream=0)
    HOST.clear()
    CAPTURING.clear()
    FILLED.clear()
    POOL.__init__()
    BACKED["on"] = backed
    cupy = types.ModuleType("cupy")
    cupy.__version__ = "0.0.0-fake"
    cupy.ndarray = ndarray
    cupy.empty = empty
    cupy.asarray = asarray
    cupy.float32, cupy.int32 = np.float32, np.int32
    cupy.uint16, cupy.uint32 = np.uint16, np.uint32
    cupy.get_default_memory_pool = lambda: POOL
    cupy.broadcast_to = broadcast_to
    runtime = types.SimpleNamespace(
        getDeviceCount=lambda: 1,
        getDevice=lambda: CURRENT["device"],
        getDeviceProperties=_properties,
        runtimeGetVersion=lambda: 13000,
        CUDARuntimeError=CUDARuntimeError,
    )
    nvrtc = types.SimpleNamespace(getVersion=lambda: (13, 0))
    cupy.cuda = types.SimpleNamespace(
        Device=_Device,
        Stream=Stream,
        ExternalStream=ExternalStream,
        get_current_stream=get_current_stream,
        runtime=runtime,
        nvrtc=nvrtc,
    )
    return cupy


class StubFunction:
    """A compiled kernel function that calls ``launch(symbol, grid, block, args, shared_mem)``;
    ``num_regs`` as CuPy's RawKernel reports it (None: unknown)."""

    def __init__(self, symbol: str, launch: Callable[..., None], num_regs: int | None) -> None:
        self.symbol, self.launch, self.num_regs = symbol, launch, num_regs

    def __call__(self, grid: Any, block: Any, args: Any, shared_mem: int = 0) -> None:
        self.launch(self.symbol, grid, block, args, shared_mem)


def stub_compile(
    launch: Callable[..., None], num_regs: int | None = None
) -> Callable[..., dict[str, Any]]:
    """A ``RuntimeKernel._compile`` whose functions call ``launch(symbol, grid, block, args,
    shared_mem)`` instead of a GPU."""

    def compile_stub(kernel: Any, cupy: Any, symbols: list[str]) -> dict[str, Any]:
        return {symbol: StubFunction(symbol, launch, num_regs) for symbol in symbols}

    return compile_stub


def encode_tensor_map(layout: Any, tensor: Any) -> np.ndarray:
    """The driver's ``cuTensorMapEncodeTiled`` as far as a launch sees it: the same checks of
    the address (16-byte aligned, InputError naming the tensor) and a 128-byte by-value map,
    here the address, dims, byte strides and box in its first 12 words (no GPU reads it)."""
    from kernelgen.runtime.tensor_maps import TENSOR_MAP_DTYPE, check_address, device_pointer

    address = device_pointer(tensor)
    check_address(layout, address)
    words = np.zeros(16, np.uint64)
    fields = [address, *layout.dims, *layout.strides_bytes, *layout.box]
    words[: len(fields)] = fields
    return words.view(TENSOR_MAP_DTYPE)


def install(launch: Callable[..., None]) -> types.ModuleType:
    """Put a fake ``cupy`` into ``sys.modules`` and make kernelgen's runtime kernels call
    ``launch`` instead of compiling (for a process of its own; tests patch with monkeypatch)."""
    from kernelgen.runtime.launch import RuntimeKernel

    fake = module()
    sys.modules["cupy"] = fake
    RuntimeKernel._compile = stub_compile(launch)  # type: ignore[method-assign]
    RuntimeKernel.encode_tensor_map = staticmethod(encode_tensor_map)  # type: ignore[assignment]
    return fake
