"""Candidate specs for a problem, and the static pruning that runs before any GPU time.

Pruning, in order (each drop is logged with its reason):

1. validation: the spec model rejects the combination (e.g. shared memory over the target
   architecture's limit, too many accumulators per thread);
2. occupancy: a candidate whose grid has fewer thread blocks than
   ``min(SM count, most blocks any candidate gives)`` is dropped: when some tiling fills the
   GPU, tilings that leave SMs idle are not worth timing;
3. resources: the offline NVRTC compile reports spill stores/loads or a stack frame (> 0 bytes),
   or the compile fails.
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from kernelgen.compile import Resources
from kernelgen.errors import KernelgenError, SpecError, ToolchainMissingError
from kernelgen.fileio import atomic_write_text
from kernelgen.spec import KernelSpec, spec_from_dict
from kernelgen.tuning.key import DeviceInfo, ProblemDesc, canonical_digest

log = logging.getLogger(__name__)

CompileFn = Callable[[KernelSpec, str], Resources]

# Tensor-core grid (fp16/bf16): block_m = 16 * num_warps.
TC_WARPS = (4, 8)
TC_BLOCK_N = (32, 64, 128)
TC_STAGES = (2, 3)
TC_LAYOUTS = ("swizzled", "padded")
# CUDA-core grid (fp32; the first entries double as fp16/bf16 fallbacks).
SIMT_BLOCK_M = (32, 64, 128)
SIMT_BLOCK_N = (16, 32, 64)
SIMT_WARPS = (4, 8)
SIMT_FALLBACKS: tuple[dict[str, Any], ...] = (
    {"loop_order": "v2", "block_m": 64, "block_n": 32, "num_warps": 4},
    {"loop_order": "v2", "block_m": 32, "block_n": 32, "num_warps": 4},
    {"loop_order": "v1", "block_m": 64, "block_n": 32, "num_warps": 4},
)


@dataclass(frozen=True)
class Candidate:
    """A spec that survived pruning (``resources`` is None when NVRTC was unavailable)."""

    spec: KernelSpec
    resources: Resources | None = None


@dataclass(frozen=True)
class Dropped:
    """A candidate removed before timing, and why (``uri`` is a readable label if invalid)."""

    uri: str
    stage: str  # "validation" | "occupancy" | "resources"
    reason: str


def candidate_fields(problem: ProblemDesc) -> Iterator[dict[str, Any]]:
    """Spec field sets worth trying for ``problem`` (tens, not thousands), best guesses first."""
    if problem.dtype in ("float16", "bfloat16"):
        for warps, block_n, stages, layout in itertools.product(
            TC_WARPS, TC_BLOCK_N, TC_STAGES, TC_LAYOUTS
        ):
            yield {
                "loop_order": "v2",
                "mma": "mma_sync",
                "block_m": 16 * warps,
                "block_n": block_n,
                "num_warps": warps,
                "stages": stages,
                "smem_layout": layout,
            }
        yield from SIMT_FALLBACKS
        return
    for block_m, block_n, warps in itertools.product(SIMT_BLOCK_M, SIMT_BLOCK_N, SIMT_WARPS):
        yield {"loop_order": "v2", "block_m": block_m, "block_n": block_n, "num_warps": warps}
    yield SIMT_FALLBACKS[-1]


def _label(fields: dict[str, Any]) -> str:
    """A readable name for a field set that is not a valid spec (so it has no URI)."""
    return " ".join(f"{k}={v}" for k, v in fields.items())


def grid_blocks(spec: KernelSpec, problem: ProblemDesc) -> int:
    """Thread blocks the launch has: v2 one per Q tile and head, v1 one per head."""
    if spec.loop_order == "v2":
        return math.ceil(problem.seqlen_q / spec.block_m) * problem.batch_heads
    return problem.batch_heads


def valid_candidates(problem: ProblemDesc, arch: str) -> tuple[list[KernelSpec], list[Dropped]]:
    """Candidate specs that pass validation for ``arch``, and those that do not."""
    specs: list[KernelSpec] = []
    dropped: list[Dropped] = []
    seen: set[str] = set()
    common = {
        "dtype": problem.dtype,
        "head_dim": problem.head_dim,
        "causal": problem.causal,
        "archs": [arch],
    }
    for fields in candidate_fields(problem):
        try:
            spec = spec_from_dict({**common, **fields})
        except SpecError as exc:
            dropped.append(Dropped(_label(fields), "validation", "; ".join(exc.problems)))
            continue
        if spec.uri not in seen:
            seen.add(spec.uri)
            specs.append(spec)
    return specs, dropped


def prune_occupancy(
    specs: list[KernelSpec], problem: ProblemDesc, sm_count: int
) -> tuple[list[KernelSpec], list[Dropped]]:
    """Drop specs whose grid has fewer blocks than min(SMs, the most any candidate gives)."""
    if not specs:
        return [], []
    target = min(sm_count, max(grid_blocks(s, problem) for s in specs))
    kept, dropped = [], []
    for spec in specs:
        blocks = grid_blocks(spec, problem)
        if blocks < target:
            reason = f"grid has {blocks} blocks for {sm_count} SMs; other tilings give {target}"
            dropped.append(Dropped(spec.uri, "occupancy", reason))
        else:
            kept.append(spec)
    return kept, dropped


def resource_problem(res: Resources) -> str | None:
    """Why ptxas' report disqualifies a kernel (spills or a stack frame), or None."""
    if res.spill_store_bytes or res.spill_load_bytes or res.stack_bytes:
        return (
            f"ptxas on {res.arch}: {res.spill_store_bytes} B spill stores, "
            f"{res.spill_load_bytes} B spill loads, {res.stack_bytes} B stack "
            f"({res.registers} registers)"
        )
    return None


def prune_resources(
    specs: list[KernelSpec], arch: str, compile_fn: CompileFn
) -> tuple[list[Candidate], list[Dropped]]:
    """Compile each spec offline; drop failures and kernels that spill or use a stack."""
    kept: list[Candidate] = []
    dropped: list[Dropped] = []
    for spec in specs:
        try:
            res = compile_fn(spec, arch)
        except ToolchainMissingError:
            raise
        except (KernelgenError, ValueError) as exc:
            first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            dropped.append(Dropped(spec.uri, "resources", f"offline compile failed: {first}"))
            continue
        why = resource_problem(res)
        if why:
            dropped.append(Dropped(spec.uri, "resources", why))
        else:
            kept.append(Candidate(spec, res))
    return kept, dropped


def prune(
    problem: ProblemDesc, device: DeviceInfo, compile_fn: CompileFn | None = None
) -> tuple[list[Candidate], list[Dropped]]:
    """Candidates for ``problem`` on ``device`` after every static check, and the drops.

    ``compile_fn`` defaults to :func:`offline_resources`; without NVRTC the resource check is
    skipped with a warning (the kernels are still compiled, by CuPy, before timing)."""
    arch = device.target_arch
    specs, dropped = valid_candidates(problem, arch)
    specs, more = prune_occupancy(specs, problem, device.sm_count)
    dropped += more
    try:
        kept, more = prune_resources(specs, arch, compile_fn or offline_resources)
    except ToolchainMissingError as exc:
        log.warning("skipping the spill/stack check (%s)", exc)
        kept, more = [Candidate(s) for s in specs], []
    dropped += more
    for d in dropped:
        log.info("dropped %s [%s]: %s", d.uri, d.stage, d.reason)
    return kept, dropped


# ---- memoized offline compile -------------------------------------------------------------
_RESOURCES: dict[tuple[str, str], Resources] = {}


@cache
def _nvrtc_version() -> str:
    from kernelgen.compile import _nvrtc

    _, major, minor = _nvrtc().nvrtcVersion()
    return f"{major}.{minor}"


def offline_resources(spec: KernelSpec, arch: str) -> Resources:
    """ptxas' resource report for ``spec`` on ``arch``, memoized in process and on disk.

    The disk entry (``<cache dir>/resources/<digest>.json``) is keyed by the spec, the arch, the
    template hash, kernelgen's version and NVRTC's; an unreadable entry is recompiled."""
    from kernelgen import __version__
    from kernelgen.compile import compile_offline
    from kernelgen.render import render, template_hash
    from kernelgen.tuning.db import cache_dir

    memo_key = (spec.canonical_json(), arch)
    if memo_key in _RESOURCES:
        return _RESOURCES[memo_key]
    identity = [spec.canonical_json(), arch, template_hash(), __version__, _nvrtc_version()]
    path = cache_dir() / "resources" / f"{spec.uri}-{arch}-{canonical_digest(identity)[:16]}.json"
    res = _read_resources(path)
    if res is None:
        res = compile_offline(render(spec), spec.uri, arch).resources
        try:
            atomic_write_text(path, json.dumps(res.as_dict(), sort_keys=True))
        except OSError as exc:
            log.debug("cannot memoize resources in %s: %s", path, exc)
    _RESOURCES[memo_key] = res
    return res


def _read_resources(path: Path) -> Resources | None:
    if not os.path.exists(path):
        return None
    try:
        return Resources(**json.loads(path.read_text()))
    except (OSError, ValueError, TypeError) as exc:
        log.warning("ignoring unreadable compile memo %s: %s", path, exc)
        return None
