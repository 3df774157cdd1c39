"""The array library of a call, CuPy or torch: its device, device pointers, output allocation and
the stream that kernels launch on.

q's library is the call's. A CuPy call launches on CuPy's current stream and returns CuPy
arrays. A torch call launches on torch's current stream of q's device and allocates its outputs
(and split-KV partials) with torch, so it is ordered with the torch work around it like any
torch operator, with no DLPack exchange or cross-stream event per call, and a torch CUDA graph
can capture it. Either way q's device is the current device while the call runs. Host arrays
(NumPy, CPU torch) are the CPU backend's (:mod:`kernelgen.runtime.host`): the same protocol, kernels
run by the emulator.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any

import numpy as np

from kernelgen.errors import CaptureError
from kernelgen.runtime.host import HOST_DEVICE, HostArrays, as_numpy, host_arrays_of, is_host_array
from kernelgen.runtime.launch import import_cupy


def module_of(array: Any) -> str:
    """The top-level module of an array's type ("cupy", "torch", "numpy", ...)."""
    return type(array).__module__.split(".")[0]


def dtype_name(dtype: Any) -> str:
    """A NumPy, CuPy or torch dtype's name ("float16", "bfloat16", ...)."""
    name = str(getattr(dtype, "name", dtype))
    return name.removeprefix("torch.")


# CuPy exchanges bfloat16 through DLPack both ways since 14.0 (with ml_dtypes); older CuPy, and
# producers without bfloat16 in their DLPack export, refuse it: a same-size integer view carries
# the bits through any version without a copy.
_DLPACK_REFUSALS = (NotImplementedError, TypeError, BufferError, ValueError)


def as_cupy(array: Any) -> Any:
    """A device array as a CuPy array sharing its memory (CUDA array interface or DLPack)."""
    cupy = import_cupy()
    if isinstance(array, cupy.ndarray):
        return array
    if hasattr(array, "__cuda_array_interface__") and module_of(array) != "torch":
        return cupy.asarray(array)
    try:
        return cupy.from_dlpack(array)
    except _DLPACK_REFUSALS:
        if dtype_name(getattr(array, "dtype", "")) != "bfloat16":
            raise
        import ml_dtypes
        import torch

        return cupy.from_dlpack(array.view(torch.int16)).view(ml_dtypes.bfloat16)


class CupyArrays:
    """Calls whose q is a CuPy array (or any other device array, viewed through CuPy)."""

    name = "cupy"
    host = False

    @staticmethod
    def device_of(array: Any) -> int:
        return int(array.device.id)

    @staticmethod
    def pointer(array: Any) -> int:
        return int(array.data.ptr)

    @staticmethod
    def signature(array: Any) -> tuple[Any, ...]:
        """What a launch depends on but the data: shape, strides, dtype, 16-byte alignment."""
        return (array.shape, array.strides, array.dtype, array.data.ptr % 16)

    @staticmethod
    def launch_arg(array: Any) -> Any:
        return array  # CuPy passes its own arrays to kernels as pointers

    @staticmethod
    def dtype_of(array: Any) -> Any:
        """The library's dtype of ``array`` (outputs are allocated with it)."""
        return as_cupy(array).dtype

    @staticmethod
    def empty(shape: tuple[int, ...], dtype: Any, device: int) -> Any:
        """Uninitialised memory on the current device (the caller's ``scope``). With
        ``TorchArrays.empty``, the hook through which checks NaN-poison kernelgen's allocations
        (:func:`kernelgen.testing.poison.poisoned_outputs`)."""
        return import_cupy().empty(shape, dtype=dtype)

    @staticmethod
    def float32() -> Any:
        return import_cupy().float32

    @staticmethod
    def int32() -> Any:
        return import_cupy().int32

    @staticmethod
    def from_host(values: np.ndarray) -> Any:
        """Host values (host ``seqlens_k``) uploaded to the current device, current stream."""
        return import_cupy().asarray(values)

    @staticmethod
    def scope(device: int) -> contextlib.AbstractContextManager[Any]:
        """``device`` current; launches go to CuPy's current stream."""
        return import_cupy().cuda.Device(device)


class TorchArrays:
    """Calls whose q is a CUDA torch tensor."""

    name = "torch"
    host = False

    @staticmethod
    def device_of(array: Any) -> int:
        return int(array.get_device())

    @staticmethod
    def pointer(array: Any) -> int:
        return int(array.data_ptr())

    @staticmethod
    def signature(array: Any) -> tuple[Any, ...]:
        """What a launch depends on but the data: shape, strides, dtype, 16-byte alignment."""
        return (array.shape, array.stride(), array.dtype, array.data_ptr() % 16)

    @staticmethod
    def launch_arg(array: Any) -> Any:
        return np.uint64(array.data_ptr())  # a raw pointer: no DLPack round trip

    @staticmethod
    def dtype_of(array: Any) -> Any:
        return array.dtype

    @staticmethod
    def empty(shape: tuple[int, ...], dtype: Any, device: int) -> Any:
        return _torch().empty(shape, dtype=dtype, device=_torch_device(device))

    @staticmethod
    def float32() -> Any:
        return _torch().float32

    @staticmethod
    def int32() -> Any:
        return _torch().int32

    # on torch's stream, which the call's scope makes CuPy's current
    from_host = staticmethod(CupyArrays.from_host)

    @staticmethod
    def scope(device: int) -> contextlib.AbstractContextManager[Any]:
        """``device`` current and torch's current stream of it as CuPy's current stream."""
        return _TorchScope(device)


class _TorchScope:
    """The context of TorchArrays.scope (a class: cheaper than a generator on every call)."""

    def __init__(self, device: int) -> None:
        stream = _torch().cuda.current_stream(device).cuda_stream
        self.contexts = (import_cupy().cuda.Device(device), cupy_stream(stream, device))

    def __enter__(self) -> None:
        device, stream = self.contexts
        device.__enter__()
        try:
            stream.__enter__()
        except BaseException:
            device.__exit__(None, None, None)
            raise

    def __exit__(self, *exc: object) -> None:
        device, stream = self.contexts
        try:
            stream.__exit__(*exc)
        finally:
            device.__exit__(*exc)


def _torch() -> Any:
    """The torch module: imported by whoever made the tensors this call got."""
    torch = sys.modules.get("torch")
    if torch is None:
        import torch
    return torch


Arrays = type[CupyArrays] | type[TorchArrays] | HostArrays

_TORCH_DEVICES: dict[int, Any] = {}
_EXTERNAL_STREAMS: dict[tuple[int, int], Any] = {}
MAX_EXTERNAL_STREAMS = 64  # torch streams remembered as CuPy streams (then the table starts over)


def _torch_device(index: int) -> Any:
    device = _TORCH_DEVICES.get(index)
    if device is None:
        device = _TORCH_DEVICES[index] = _torch().device("cuda", index)
    return device


class _StreamPointer:
    """A raw stream pointer as the CUDA stream protocol's ``__cuda_stream__``."""

    def __init__(self, ptr: int) -> None:
        self.ptr = ptr

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, self.ptr)


def cupy_stream(ptr: int, device: int) -> Any:
    """CuPy's handle of the stream ``ptr`` of ``device`` (kept: torch streams are few).

    ``Stream.from_external`` (ExternalStream warns since CuPy 14) leaves the device unknown
    (14.2) or takes the current one; the handle is given ``device``, so that entering it on
    another device raises as ``ExternalStream(ptr, device)`` did."""
    stream = _EXTERNAL_STREAMS.get((ptr, device))
    if stream is None:
        if len(_EXTERNAL_STREAMS) >= MAX_EXTERNAL_STREAMS:
            _EXTERNAL_STREAMS.clear()
        stream = import_cupy().cuda.Stream.from_external(_StreamPointer(ptr))
        stream.device_id = device
        _EXTERNAL_STREAMS[(ptr, device)] = stream
    return stream


def refuse_during_capture(name: str, value: Any, allowed: str) -> None:
    """Raise a CaptureError naming argument ``name`` when the current CuPy stream (the call's:
    it runs in its library's ``scope``) is capturing a CUDA graph."""
    if import_cupy().cuda.get_current_stream().is_capturing():
        raise CaptureError(
            f"{name} is {type(value).__name__} while the call's stream captures a CUDA graph, "
            f"which needs an upload or a temporary the graph cannot keep; pass {allowed}"
        )


def arrays_of(q: Any) -> Arrays:
    """The library a call with query ``q`` runs in."""
    if is_host_array(q):
        return host_arrays_of(q)
    return TorchArrays if module_of(q) == "torch" else CupyArrays


def device_of(array: Any) -> int:
    """The CUDA device index of any device array attention() accepts (host arrays: -1)."""
    if is_host_array(array):
        return HOST_DEVICE
    if module_of(array) == "torch":
        return TorchArrays.device_of(array)
    return CupyArrays.device_of(as_cupy(array))


def pointer_of(array: Any) -> int:
    """The address of any array attention() accepts (host arrays: their host address)."""
    if isinstance(array, np.ndarray):
        return int(array.ctypes.data)
    if module_of(array) == "torch":
        return TorchArrays.pointer(array)
    return CupyArrays.pointer(as_cupy(array))


def launch_arg(arrays: Arrays, array: Any) -> Any:
    """``array`` as a kernel argument of a call in ``arrays``' library (foreign arrays, e.g. a
    CuPy mask with a torch q, go as device pointers to torch calls and as CuPy views to CuPy's;
    host calls take any host array, as a NumPy view)."""
    if arrays.host:
        return as_numpy(array)
    if module_of(array) == arrays.name:
        return arrays.launch_arg(array)
    if arrays is CupyArrays:
        return as_cupy(array)
    return np.uint64(pointer_of(array))


def float32_broadcast(mask: Any, shape: tuple[int, ...]) -> tuple[Any, tuple[int, ...]]:
    """An additive mask as float32 broadcast to ``shape`` (a copy only for other dtypes), in its
    own library (CuPy for anything but torch and NumPy), with its strides in elements (0:
    broadcast)."""
    if isinstance(mask, np.ndarray):
        mask = np.broadcast_to(mask.astype(np.float32, copy=False), shape)
        return mask, tuple(s // 4 for s in mask.strides)
    if module_of(mask) == "torch":
        torch = _torch()
        if mask.dtype != torch.float32:
            mask = mask.to(torch.float32)
        mask = mask.expand(shape)
        return mask, tuple(mask.stride())
    cupy = import_cupy()
    mask = as_cupy(mask)
    if mask.dtype != cupy.float32:
        refuse_during_capture("mask", mask, "a float32 mask, or a mask of q's library")
        mask = mask.astype(cupy.float32)
    mask = cupy.broadcast_to(mask, shape)
    return mask, tuple(s // 4 for s in mask.strides)
