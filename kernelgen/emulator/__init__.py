"""Run CUDA kernels on the CPU: one fiber per CUDA thread, PTX semantics, race checks.

The kernel's CUDA source is preprocessed and compiled as C++20 by ``g++`` against a small shim
(``include/kg_emulator.h``) that supplies the CUDA subset it uses; inline PTX (ldmatrix,
mma.sync m16n8k16, cp.async; Hopper's wgmma (fp8 too), mbarrier, TMA loads and stores,
stmatrix, named barriers and clusters) becomes calls into
``include/kg_ptx.h``. Then it is loaded with
:mod:`ctypes` and launched over NumPy arrays::

    from kernelgen.emulator import build_kernel

    kern = build_kernel(source, "saxpy", [("float", "a"), ("const float*", "x"), ("float*", "y")])
    stats = kern(grid=4, block=128, shared_mem=0, args=[2.0, x, y])
    stats.ldmatrix_wavefronts, stats.cp_async_global_bytes

A launch returns :class:`LaunchStats` (ldmatrix bank-conflict wavefronts, cp.async global
bytes, per argument too) and raises a :class:`~kernelgen.errors.EmulatorLaunchError` for a
trap or a bad shared-memory access, :class:`~kernelgen.errors.HazardError` for a missing
cp.async wait or barrier, :class:`~kernelgen.errors.EmulatorTimeoutError` for a deadlock.
What is modelled and what is not: docs/emulator.md. Needs only g++ (C++20) on Linux.

The package imports nothing of kernelgen but its errors and file helpers: kernelgen's specs run
on it through the CPU backend (:mod:`kernelgen.runtime.host`,
:mod:`kernelgen.runtime.emulated_launch`, :mod:`kernelgen.calls.emulated`).
"""

from kernelgen.emulator.kernel import (
    MAX_DYNAMIC_SMEM,
    EmulatedKernel,
    LaunchStats,
    build_kernel,
    build_kernels,
    include_dir,
)
from kernelgen.emulator.tensor_map import TensorMap, encode_tensor_map_tiled
from kernelgen.emulator.transform import PTX_FORMS, transform_source
from kernelgen.errors import (
    EmulatorArgumentError,
    EmulatorArgumentTypeError,
    EmulatorCompileError,
    EmulatorError,
    EmulatorLaunchError,
    EmulatorSettingError,
    EmulatorSourceError,
    EmulatorTimeoutError,
    EmulatorUnavailableError,
    HazardError,
)

__all__ = [
    "MAX_DYNAMIC_SMEM",
    "PTX_FORMS",
    "EmulatedKernel",
    "EmulatorArgumentError",
    "EmulatorArgumentTypeError",
    "EmulatorCompileError",
    "EmulatorError",
    "EmulatorLaunchError",
    "EmulatorSettingError",
    "EmulatorSourceError",
    "EmulatorTimeoutError",
    "EmulatorUnavailableError",
    "HazardError",
    "LaunchStats",
    "TensorMap",
    "build_kernel",
    "build_kernels",
    "encode_tensor_map_tiled",
    "include_dir",
    "transform_source",
]
