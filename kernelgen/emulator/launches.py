"""A kernelgen spec's launch plan run on the emulator: the generated CUDA over NumPy arrays.

The same plan as on the GPU (:func:`kernelgen.launch.launch_steps`, its arguments and scratch
buffers); only the launcher differs. Sits below :mod:`kernelgen.api` (it takes a checked
:class:`~kernelgen.launch.Problem`, not user tensors).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache

import numpy as np

from kernelgen.emulator.kernel import EmulatedKernel, LaunchStats, build_kernel
from kernelgen.launch import Problem, kernel_arguments, launch_steps, scratch_floats
from kernelgen.render import render
from kernelgen.spec import KernelSpec
from kernelgen.tensor_maps import encode_on_host, tensor_map_arguments, tensor_map_layouts

__all__ = ["from_device_dtype", "run_launches", "spec_kernel", "to_device_dtype"]


@cache
def spec_kernel(
    spec: KernelSpec, symbol: str, params: tuple, source: str | None = None
) -> EmulatedKernel:
    """The emulated kernel ``symbol`` (the main kernel or the split-KV combine) of ``spec``,
    built from ``source`` (default: the spec's rendered CUDA), once per process."""
    text = render(spec) if source is None else source
    return build_kernel(text, symbol, [(p.ctype, p.name) for p in params])


def to_device_dtype(x: np.ndarray, dtype: str) -> np.ndarray:
    """Float values as the kernel's element type: float16, bfloat16 as uint16 bit patterns
    (round to nearest even), or float32."""
    if dtype == "float16":
        return np.asarray(x).astype(np.float16)
    if dtype == "bfloat16":
        bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
        return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    return np.asarray(x).astype(np.float32)


def from_device_dtype(x: np.ndarray, dtype: str) -> np.ndarray:
    """A kernel's output as float32 (bfloat16 bit patterns widened)."""
    if dtype == "bfloat16":
        return (x.astype(np.uint32) << 16).view(np.float32)
    return x.astype(np.float32)


def run_launches(
    spec: KernelSpec,
    problem: Problem,
    arrays: dict[str, np.ndarray],
    scale: float,
    *,
    source: str | None = None,
    on_step: Callable[[int, int], None] | None = None,
) -> dict[str, LaunchStats]:
    """Every launch of the spec's plan for ``problem``, in order, over ``arrays`` (q, k, v, out
    and the optional lse, mask, seqlens_k by parameter name); the scratch buffers are added to
    ``arrays`` poisoned with NaN, and a wgmma spec's tensor maps of q, k and v. Returns each
    kernel's launch statistics by symbol.

    ``source`` replaces the rendered CUDA (e.g. a modified kernel); ``on_step(done, total)`` is
    called after each launch."""
    for name, floats in scratch_floats(spec, problem).items():
        arrays[name] = np.full(floats, np.nan, dtype=np.float32)
    if spec.engine.warp_specialized:  # q, k and v reach the kernel as TMA tensor maps
        layouts = tensor_map_layouts(spec, problem)
        arrays.update(tensor_map_arguments(layouts, arrays, encode_on_host))
    stats: dict[str, LaunchStats] = {}
    steps = launch_steps(spec, problem)
    for i, step in enumerate(steps):
        args = kernel_arguments(step.params, problem, arrays, scale, null=None)
        kernel = spec_kernel(spec, step.symbol, step.params, source)
        launched = kernel(grid=step.grid, block=step.block, shared_mem=step.shared_mem, args=args)
        stats[step.symbol] = stats.get(step.symbol, LaunchStats()) + launched
        if on_step is not None:
            on_step(i + 1, len(steps))
    return stats
