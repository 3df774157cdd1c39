"""A kernelgen spec's kernels built by the emulator, and what their launches report.

The CPU backend (:mod:`kernelgen.runtime.host`) launches these kernels through the same
:class:`~kernelgen.runtime.launch.PreparedLaunch` as a GPU call; only the runner differs. Within
:func:`recording`, the emulated launches of a call report into a :class:`Recording` (the final
Problem, each kernel's :class:`~kernelgen.emulator.LaunchStats`, every array the kernels saw):
what ``kernelgen emulate`` and the emulation tests read (:mod:`kernelgen.calls.emulated`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field
from functools import cache
from typing import Any

import numpy as np

from kernelgen.emulator.kernel import EmulatedKernel, LaunchStats, build_kernels
from kernelgen.kernels.render import combine_params, kernel_params, render
from kernelgen.runtime.launch import Problem, kernel_arguments, launch_steps, scratch_floats
from kernelgen.runtime.tensor_maps import encode_on_host, tensor_map_arguments, tensor_map_layouts
from kernelgen.specs.forward import KernelSpec

__all__ = [
    "Recording",
    "active_recording",
    "from_device_dtype",
    "recording",
    "run_launches",
    "spec_kernel",
    "spec_kernels",
    "to_device_dtype",
]


@cache
def spec_kernels(
    spec: Any, kernels: tuple[tuple[str, tuple], ...], source: str | None = None
) -> dict[str, EmulatedKernel]:
    """The emulated kernels ``kernels`` ((symbol, params) pairs: every kernel of the spec's
    launch plan) of ``spec`` (of any family), built from ``source`` (default: the forward
    spec's rendered CUDA) into one library, once per process."""
    text = render(spec) if source is None else source
    params = {symbol: [(p.ctype, p.name) for p in ps] for symbol, ps in kernels}
    return build_kernels(text, params)


def spec_kernel(spec: Any, symbol: str, params: tuple, source: str | None = None) -> EmulatedKernel:
    """The emulated kernel ``symbol`` of ``spec`` (see :func:`spec_kernels`). A forward spec's
    main kernel and split-KV combine are built together, into one library."""
    kernels = ((symbol, tuple(params)),)
    if isinstance(spec, KernelSpec):
        siblings = _forward_kernels(spec)
        if kernels[0] in siblings:
            kernels = siblings
    return spec_kernels(spec, kernels, source)[symbol]


def _forward_kernels(spec: KernelSpec) -> tuple[tuple[str, tuple], ...]:
    """A forward spec's kernels: the main kernel, and the combine of a split-KV spec."""
    kernels = ((spec.uri, tuple(kernel_params(spec))),)
    if spec.split_kv:
        kernels += ((spec.combine_uri, tuple(combine_params(spec))),)
    return kernels


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


@dataclass
class Recording:
    """What the emulated launches of one call reported: the Problem they were planned for (split
    count and paging included), each kernel's launch statistics by symbol (summed over its
    launches), and every array argument by parameter name as the kernels saw it (scratch
    buffers cut to their size). ``source`` replaces the rendered CUDA of the call's forward
    spec (e.g. a mutated kernel); ``on_step(done, total)`` runs after each launch."""

    source: str | None = None
    on_step: Callable[[int, int], None] | None = None
    problem: Problem | None = None
    stats: dict[str, LaunchStats] = field(default_factory=dict)
    arrays: dict[str, np.ndarray] = field(default_factory=dict)
    launches: int = 0  # planned
    done: int = 0
    scratch: dict[str, int] = field(default_factory=dict)  # floats of each scratch buffer

    def planned(self, problem: Problem, launches: int, scratch: dict[str, int]) -> None:
        """A launch was prepared: ``launches`` kernels for ``problem``, with ``scratch``."""
        self.problem, self.launches, self.scratch = problem, launches, dict(scratch)

    def launched(
        self, symbol: str, names: Sequence[str], values: Sequence[Any], stats: LaunchStats
    ) -> None:
        """Kernel ``symbol`` ran with ``values`` (its parameters ``names``) and gave ``stats``."""
        self.stats[symbol] = self.stats.get(symbol, LaunchStats()) + stats
        for name, value in zip(names, values, strict=True):
            if isinstance(value, np.ndarray):  # scratch pointers resolve to the rest of a buffer
                floats = self.scratch.get(name)
                self.arrays[name] = value if floats is None else value[:floats]
        self.done += 1
        if self.on_step is not None:
            self.on_step(self.done, self.launches)


_ACTIVE: ContextVar[Recording | None] = ContextVar("kernelgen_emulated_recording", default=None)


def active_recording() -> Recording | None:
    """The recording emulated launches report into now (None: not recorded)."""
    return _ACTIVE.get()


@contextlib.contextmanager
def recording(
    source: str | None = None, on_step: Callable[[int, int], None] | None = None
) -> Iterator[Recording]:
    """Within the block, the CPU backend's launches (this thread's) report into the yielded
    :class:`Recording`, and its kernels are built from ``source`` when given."""
    recorded = Recording(source, on_step)
    token = _ACTIVE.set(recorded)
    try:
        yield recorded
    finally:
        _ACTIVE.reset(token)


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
    and the optional lse, mask, seqlens_k by parameter name), outside any call of the API: for
    tests that launch into buffers they lay out themselves. The scratch buffers are added to
    ``arrays`` poisoned with NaN, and a wgmma spec's tensor maps. Returns each kernel's launch
    statistics by symbol.

    ``source`` replaces the rendered CUDA (e.g. a modified kernel); ``on_step(done, total)`` is
    called after each launch."""
    for name, floats in scratch_floats(spec, problem).items():
        arrays[name] = np.full(floats, np.nan, dtype=np.float32)
    if spec.engine.warp_specialized:  # q, k and v reach the kernel as TMA tensor maps
        layouts = tensor_map_layouts(spec, problem)
        arrays.update(tensor_map_arguments(layouts, arrays, encode_on_host))
    stats: dict[str, LaunchStats] = {}
    steps = launch_steps(spec, problem)
    kernels = spec_kernels(spec, tuple((s.symbol, tuple(s.params)) for s in steps), source)
    for i, step in enumerate(steps):
        args = kernel_arguments(step.params, problem, arrays, scale, null=None)
        kernel = kernels[step.symbol]
        launched = kernel(grid=step.grid, block=step.block, shared_mem=step.shared_mem, args=args)
        stats[step.symbol] = stats.get(step.symbol, LaunchStats()) + launched
        if on_step is not None:
            on_step(i + 1, len(steps))
    return stats
