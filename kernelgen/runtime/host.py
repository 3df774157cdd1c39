"""The CPU backend: attention() on NumPy arrays and CPU torch tensors, its kernels run by the
emulator (:mod:`kernelgen.emulator`).

A call whose q is a host array takes the GPU path of :mod:`kernelgen.calls.attention` unchanged
(checks, the heuristic default spec, the call plan, split-KV, decode packing, the same launches and
arguments); only the array library (:class:`NumpyArrays`, :class:`TorchCpuArrays`: the
``Arrays`` of :mod:`kernelgen.runtime.frameworks`) and the kernel runner
(:class:`EmulatedRuntimeKernel`, the generated CUDA compiled by g++ instead of NVRTC) differ. No
tuning: there is no GPU to time. It is for correctness and debugging, not speed: the first call
warns once (:class:`~kernelgen.errors.CPUBackendWarning`), and its allocations start as NaN (every
bit set) so that an element a kernel leaves unwritten shows. Within
:func:`kernelgen.runtime.emulated_launch.recording` (``kernelgen emulate``, the emulation tests),
the launches report what they ran and the call does not warn. See docs/emulator.md.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import warnings
import weakref
from typing import Any

import numpy as np

from kernelgen.errors import CPUBackendWarning, caller_stacklevel
from kernelgen.runtime.launch import (
    PreparedLaunch,
    Problem,
    RuntimeKernel,
    default_num_splits,
    scratch_floats,
)
from kernelgen.runtime.tensor_maps import TensorMapLayout, encode_on_host
from kernelgen.specs.forward import KernelSpec

HOST_DEVICE = -1  # the device index of host arrays (torch's get_device() of a CPU tensor)
# What the heuristic default spec and split count are chosen for on the CPU: the tensor-core
# instructions the emulator models (mma.sync, ldmatrix, cp.async) are sm_80's; the spec is the
# portable default (arch None: every supported arch), the split count that of a small device
# (a few key chunks for a decode step, as on a GPU, without the cost of a hundred).
EMULATED_CAPABILITY = 80
EMULATED_SM_COUNT = 8
EMULATED_ARCH = "sm_80"

__all__ = [
    "HOST_DEVICE",
    "EmulatedRuntimeKernel",
    "NumpyArrays",
    "TorchCpuArrays",
    "emulated_kernel",
    "host_arrays_of",
    "is_host_array",
]


def _module_of(array: Any) -> str:
    return type(array).__module__.split(".")[0]


def is_host_array(array: Any) -> bool:
    """Whether ``array`` is a NumPy array or a CPU torch tensor (the CPU backend's inputs)."""
    if isinstance(array, np.ndarray):
        return True
    return _module_of(array) == "torch" and getattr(array.device, "type", None) == "cpu"


_WARNED = threading.Event()


def warn_once() -> None:
    """The CPU backend's one warning per process: correct results, emulator speed."""
    if not _WARNED.is_set():
        _WARNED.set()
        warnings.warn(
            "kernelgen.attention() got host arrays (NumPy / CPU torch): it runs the generated "
            "CUDA in the CPU emulator, which is for correctness and debugging, not speed (a "
            "small call takes seconds); pass CUDA arrays to run on a GPU",
            CPUBackendWarning,
            stacklevel=caller_stacklevel(),
        )


# Host allocations made by the backend, by address: scratch buffers reach the kernels as
# pointers (PreparedLaunch.scratch_pointers), which the runner turns back into arrays here.
_ALLOCATIONS: weakref.WeakValueDictionary[int, np.ndarray] = weakref.WeakValueDictionary()


def _allocate(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """A host allocation of the backend, poisoned: every bit set is a NaN in each float type
    (bfloat16 bits too) and -1 in the integer ones."""
    array = np.empty(shape, dtype=dtype)
    array.reshape(-1).view(np.uint8).fill(0xFF)
    _ALLOCATIONS[array.ctypes.data] = array
    return array


def array_at(address: int) -> np.ndarray:
    """The memory at ``address`` in a live allocation of this backend, from there to its end."""
    for start, array in list(_ALLOCATIONS.items()):
        flat = array.reshape(-1)
        if start <= address < start + flat.nbytes:
            return flat[(address - start) // flat.itemsize :]
    raise RuntimeError(f"pointer {address:#x} is in no live host allocation of kernelgen")


def as_numpy(array: Any) -> np.ndarray:
    """A host array as a NumPy view (no copy): CPU torch tensors through ``.numpy()``,
    bfloat16 as its uint16 bits (what the kernels read)."""
    if isinstance(array, np.ndarray):
        return array
    torch = sys.modules["torch"]
    tensor = array.detach()
    if tensor.dtype == torch.bfloat16:
        return tensor.view(torch.int16).numpy().view(np.uint16)
    return tensor.numpy()


class _HostArrays:
    """What the NumPy and CPU-torch libraries share: no device, no stream, NumPy views as
    kernel arguments, emulated kernels."""

    host = True  # api: the heuristic spec (no tuning), an emulated kernel

    @staticmethod
    def device_of(array: Any) -> int:
        return HOST_DEVICE

    @staticmethod
    def launch_arg(array: Any) -> Any:
        return as_numpy(array)

    @staticmethod
    def from_host(values: np.ndarray) -> Any:
        """Host values (uploaded host ``seqlens_k``) as a kernel argument: themselves."""
        return values

    @staticmethod
    def scope(device: int) -> contextlib.AbstractContextManager[Any]:
        from kernelgen.runtime.emulated_launch import active_recording

        if active_recording() is None:  # a recorded call asked for the emulator
            warn_once()
        return contextlib.nullcontext()


class NumpyArrays(_HostArrays):
    """Calls whose q is a NumPy array: NumPy outputs (bfloat16 through ml_dtypes)."""

    name = "numpy"

    @staticmethod
    def pointer(array: Any) -> int:
        return int(array.ctypes.data)

    @staticmethod
    def signature(array: Any) -> tuple[Any, ...]:
        return (array.shape, array.strides, array.dtype, array.ctypes.data % 16)

    @staticmethod
    def dtype_of(array: Any) -> Any:
        return array.dtype

    @staticmethod
    def empty(shape: tuple[int, ...], dtype: Any, device: int) -> Any:
        return _allocate(shape, dtype)

    @staticmethod
    def float32() -> Any:
        return np.dtype(np.float32)

    @staticmethod
    def int32() -> Any:
        return np.dtype(np.int32)


class TorchCpuArrays(_HostArrays):
    """Calls whose q is a CPU torch tensor: CPU torch outputs over NumPy memory."""

    name = "torch"

    @staticmethod
    def pointer(array: Any) -> int:
        return int(array.data_ptr())

    @staticmethod
    def signature(array: Any) -> tuple[Any, ...]:
        return (array.shape, array.stride(), array.dtype, array.data_ptr() % 16)

    @staticmethod
    def dtype_of(array: Any) -> Any:
        return array.dtype

    @staticmethod
    def empty(shape: tuple[int, ...], dtype: Any, device: int) -> Any:
        torch = sys.modules["torch"]
        if dtype == torch.bfloat16:
            return torch.from_numpy(_allocate(shape, np.dtype(np.int16))).view(torch.bfloat16)
        return torch.from_numpy(_allocate(shape, np.dtype(str(dtype).removeprefix("torch."))))

    @staticmethod
    def float32() -> Any:
        return sys.modules["torch"].float32

    @staticmethod
    def int32() -> Any:
        return sys.modules["torch"].int32


HostArrays = type[NumpyArrays] | type[TorchCpuArrays]


def host_arrays_of(q: Any) -> HostArrays:
    """The host library of a call with host query ``q``."""
    return TorchCpuArrays if _module_of(q) == "torch" else NumpyArrays


class _EmulatedFunction:
    """One kernel of a spec built by the emulator (from ``source`` when given, else the spec's
    rendered CUDA), called like a CuPy RawKernel: ``function(grid, block, args, shared_mem=)``,
    pointers (``np.uint64``) resolved to arrays; reports to the active recording."""

    def __init__(self, spec: KernelSpec, symbol: str, source: str | None = None) -> None:
        from kernelgen.kernels.render import combine_params, kernel_params
        from kernelgen.runtime.emulated_launch import spec_kernel

        params = kernel_params(spec) if symbol == spec.uri else combine_params(spec)
        self.symbol = symbol
        self.names = [p.name for p in params]
        self.kernel = spec_kernel(spec, symbol, params, source)

    def __call__(self, grid: Any, block: Any, args: tuple[Any, ...], shared_mem: int = 0) -> None:
        from kernelgen.runtime.emulated_launch import active_recording

        values = [
            (array_at(int(a)) if int(a) else None) if type(a) is np.uint64 else a for a in args
        ]
        stats = self.kernel(grid=grid, block=block, shared_mem=shared_mem, args=values)
        recorded = active_recording()
        if recorded is not None:
            recorded.launched(self.symbol, self.names, values, stats)


def encode_host_tensor_map(layout: TensorMapLayout, tensor: Any) -> Any:
    """A wgmma launch's tensor map of a host tensor (an array, or a pointer into a live host
    allocation as the launch path passes it), by the emulator's encoder."""
    array = array_at(int(tensor)) if isinstance(tensor, (int, np.integer)) else tensor
    return encode_on_host(layout, array)


class EmulatedRuntimeKernel(RuntimeKernel):
    """A spec's kernels built for the CPU emulator (g++), launched by the same
    :class:`~kernelgen.runtime.launch.PreparedLaunch` as on a GPU."""

    encode_tensor_map = staticmethod(encode_host_tensor_map)

    def __init__(self, spec: KernelSpec, source: str | None = None) -> None:
        # no super().__init__: nothing of CuPy's
        self.spec = spec
        self._prepared = {}
        symbols = [spec.uri] + ([spec.combine_uri] if spec.split_kv else [])
        self.functions = {symbol: _EmulatedFunction(spec, symbol, source) for symbol in symbols}

    def prepare(
        self, problem: Problem, scale: float, num_splits: int | None = None
    ) -> PreparedLaunch:
        """:meth:`RuntimeKernel.prepare`; the active recording learns the launch's Problem, its
        number of launches and its scratch buffers' sizes."""
        from kernelgen.runtime.emulated_launch import active_recording

        launch = super().prepare(problem, scale, num_splits)
        recorded = active_recording()
        if recorded is not None:
            scratch = scratch_floats(self.spec, launch.problem)
            recorded.planned(launch.problem, len(launch.steps), scratch)
        return launch

    def default_num_splits(self, problem: Any) -> int:
        return default_num_splits(self.spec, problem, EMULATED_SM_COUNT, EMULATED_ARCH)


_KERNELS: dict[KernelSpec, EmulatedRuntimeKernel] = {}
_KERNELS_LOCK = threading.Lock()


def emulated_kernel(spec: KernelSpec) -> EmulatedRuntimeKernel:
    """The emulated kernels of ``spec``, built once per process (g++ output is cached on disk).
    A recorded call's are not kept: taken afresh from the cache of
    :func:`kernelgen.runtime.emulated_launch.spec_kernels` (which tests clear to rebuild), from the
    recording's ``source`` when it has one."""
    from kernelgen.runtime.emulated_launch import active_recording

    recorded = active_recording()
    if recorded is not None:
        return EmulatedRuntimeKernel(spec, recorded.source)
    kernel = _KERNELS.get(spec)
    if kernel is None:
        with _KERNELS_LOCK:
            kernel = _KERNELS.get(spec)
            if kernel is None:
                kernel = _KERNELS[spec] = EmulatedRuntimeKernel(spec)
    return kernel
