"""Candidate specs for a problem, and the static pruning that runs before any GPU time.

A candidate is a launch: a spec and, for split-KV specs, the number of key chunks. fp8
problems get the fp8 loops (:data:`FP8_LOOPS`) on a 9.0 device only, fp8 decode and paged
problems the fp8 forms of the Hopper decode grid (:func:`wgmma_decode_fields`). Decode
problems (:func:`kernelgen.model.policy.decode_rows`: at most 16 queries, or at most 64 packed rows)
get the split-KV decode grid instead of the prefill grid, each spec with a few split counts
around the launch heuristic. Backward problems get the backward family's grids, one per engine
(:data:`BACKWARD_GRIDS`).

Pruning, in order (each drop is logged with its reason):

1. validation: the spec model rejects the combination (e.g. shared memory over the target
   architecture's limit, too many accumulators per thread);
2. occupancy: a launch whose grid has fewer thread blocks than
   ``min(SM count, most blocks any launch gives)`` is dropped: when some launch fills the
   GPU, launches that leave SMs idle are not worth timing (a backward spec: its main kernel's
   grid, a block per key tile and K/V head);
3. resources: the offline NVRTC compile fails, or fails the static bar of ``kernelgen check``
   (:func:`kernelgen.kernels.build.static_problems`: spill or stack bytes, local memory in the
   SASS).
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import os
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from kernelgen.errors import (
    InputError,
    KernelgenError,
    SettingError,
    SpecError,
    ToolchainMissingError,
)
from kernelgen.families import AnySpec, backward, spec_of_family
from kernelgen.fileio import atomic_write_bytes, atomic_write_text
from kernelgen.kernels.build import static_problems
from kernelgen.kernels.compile import Resources, parse_ptxas_report
from kernelgen.model import policy as policy
from kernelgen.model.policy import HOPPER_DEVICE_ARCH
from kernelgen.runtime.launch import MAX_SPLITS, Problem, default_num_splits, launch_geometry
from kernelgen.specs.arch import ARCHS
from kernelgen.specs.backward import TC_DTYPES, BackwardSpec
from kernelgen.specs.backward import TC_STAGES as BACKWARD_TC_STAGES
from kernelgen.specs.forward import (
    FP8_BLOCK_N_BY_HEAD_DIM,
    FP8_DTYPE,
    WGMMA_ARCHS,
    WGMMA_HEAD_DIMS,
    KernelSpec,
    default_smem_layout,
)
from kernelgen.tuning.key import DeviceInfo, ProblemDesc, canonical_digest, spec_fields

log = logging.getLogger(__name__)

CompileFn = Callable[[AnySpec, str], Resources]

# Tensor-core grid (fp16/bf16): (num_warps, query rows per warp), block_m = their product. Two
# m16 tiles per warp (FlashAttention 2's 128-row, 4-warp tile; 256 rows over 8 warps) halve the
# K/V fragment reads per flop but double the accumulators: spec validation and ptxas spills
# prune them for wide heads. 48-key tiles fit 32-row warps at head dim 128 (176 accumulators).
TC_WARP_TILINGS = ((4, 16), (8, 16), (4, 32), (8, 32))
TC_BLOCK_N = (32, 48, 64, 128)
TC_STAGES = (2, 3)
TC_LAYOUTS = ("swizzled", "padded")
# Hopper grid (wgmma, fp16/bf16, offered only on compute capability 9.0, compiled for sm_90a):
# one or two consumer warpgroups x key tile x the intra-warpgroup overlap, and for two consumers
# the ping-pong between them, on the plain loop and on the overlapped one (whose worth only
# timing can tell: the static model does not see the latency either hides). Two K/V stages: the
# producer warp keeps the TMA ring full without stealing issue slots (FlashAttention 3 runs two
# at head dim 128), and a third would double the grid. The overlapped loop takes one stage
# more (it releases a slot one key tile later, so with two stages each tile's copy would wait
# for that release; spec validation drops it where shared memory is short).
WGMMA_BLOCK_M = (128, 64)
WGMMA_BLOCK_N = (128, 64)
WGMMA_STAGES = (2,)
WGMMA_OVERLAP = (False, True)
# One wider tiling, without the overlap (whose registers it lacks at head dim 128): 128 x 176,
# FlashAttention 3's non-causal d128 tile (763 instructions per unit against 805 at 128 x 128;
# docs/hopper.md). Its twins are added as for the others but Q in registers (184 accumulators
# at d128); head dim 256 refuses it.
WGMMA_WIDE_TILINGS = ((128, 176),)
# Tilings of one head dim only: at 192, 128-key tiles do not fit in shared memory (246,848 bytes
# at 2 stages) and 64-key ones re-read Q twice as often, so the grid adds 96 and 112 keys (895
# and 898 instructions, 88 and 86 KiB per unit against 1030 and 96 KiB at 64 keys; the model
# puts 64 keys at the shared-memory bound and these at the tensor one; docs/hopper.md). At 128,
# 144 keys with Q in registers: 808 instructions and 48 KiB per unit (168 accumulators, the
# engine's budget). At 256, 128 x 80, FlashAttention 3's d256 tile: 1102 instructions and 122
# KiB per unit against 1222 and 128 at 64 keys, 168 accumulators, 230,464 bytes of shared memory.
WGMMA_HEAD_DIM_TILINGS: dict[int, tuple[tuple[int, int], ...]] = {
    128: ((128, 144),),
    192: ((128, 96), (128, 112)),
    256: ((128, 80),),
}
# CUDA-core grid (fp32; the first entries double as fp16/bf16 fallbacks).
SIMT_BLOCK_M = (32, 64, 128)
SIMT_BLOCK_N = (16, 32, 64)
SIMT_WARPS = (4, 8)
# Offline compiles of one tuning run in flight at once.
COMPILE_THREADS = min(16, os.cpu_count() or 1)
# Decode grid (split-KV, GQA heads packed into the rows): block_n x stages; the warps are the
# fewest whose 16-row tiles hold the packed rows, and half that.
DECODE_BLOCK_N = (32, 64, 128)
DECODE_STAGES = (2, 3)
# Hopper decode grid (wgmma, offered only on compute capability 9.0 devices, beside the mma.sync
# grid: the untuned decode default stays mma.sync until a GPU has timed these): packed GQA in
# one consumer warpgroup (two past 64 packed rows) x key tiles x split or not, 2 stages (fp8 on
# a paged cache 3: see kernelgen.model.policy.fp8_decode_spec). Packing
# where the group divides block_m (a TMA box holds whole queries); a paged problem takes them all
# (a tile that lies in one page is one TMA copy, others are copied row by row with cp.async:
# which is faster is for a GPU to time). fp8 decode and paged problems take the same grid with
# V transposed in the kernel (the cache read in place), at the key tiles fp8 has for the head
# dim: a page size that 64 divides but 128 does not is then timed both ways (TMA and row copies).
WGMMA_DECODE_BLOCK_N = (64, 128)
# fp8 (e4m3) grid (wgmma, compute capability 9.0 only; docs/hopper.md, fp8): the loops of each
# fp8 tiling (128-row tiles, the head dim's key tiles: FP8_BLOCK_N_BY_HEAD_DIM), (stages,
# switches); spec validation drops those a tiling refuses (d64: the TMA store; d256, and d192
# at 128-key tiles: the overlap and Q in registers, for want of registers). The overlapped
# loops take a third stage, as in the 16-bit grid; which loop pays is for a GPU to time (the
# static model puts them all at the exponentials' bound).
FP8_LOOPS: tuple[tuple[int, dict[str, Any]], ...] = (
    (2, {}),
    (2, {"q_in_registers": True}),
    (3, {"overlap": True}),
    (3, {"overlap": True, "q_in_registers": True}),
    (2, {"pingpong": True}),
    (2, {"epilogue": "tma"}),  # the plain loop's TMA-store twin, as in the 16-bit grid
    # the plain loop with V transposed in the kernel: no V^T copy per call (the bench times
    # the host layout's with its launches), but 8 KiB more shared-memory traffic per 64 x 64
    # unit at d128, which the model ranks last there (288 clk/unit against 264) and equal at
    # d64 and d96 (docs/hopper.md, "V transposed in the kernel")
    (2, {"fp8_v_layout": "kernel"}),
)
# A paged cache whose page size is no multiple of 32 (16, 48, ...) also tries 16-key tiles: a
# tile that lies in one page costs one block-table load (docs/design-decisions.md).
PAGED_SMALL_BLOCK_N = 16
SIMT_FALLBACKS: tuple[dict[str, Any], ...] = (
    {"loop_order": "v2", "block_m": 64, "block_n": 32, "num_warps": 4},
    {"loop_order": "v2", "block_m": 32, "block_n": 32, "num_warps": 4},
    {"loop_order": "v1", "block_m": 64, "block_n": 32, "num_warps": 4},
)
# Backward grid of the CUDA-core engine: query tiles x key tiles x warps (27 field sets;
# validation drops those over the accumulator limit or the arch's shared memory).
BACKWARD_SIMT_TILES = (16, 32, 64)
BACKWARD_SIMT_WARPS = (2, 4, 8)
BACKWARD_TC_TILES = (64, 128)
BACKWARD_TC_WARPS = (4, 8)


@dataclass(frozen=True)
class TunedLaunch:
    """What attention() runs: a spec, and for a split-KV spec its key chunks (None: the launch
    heuristic, :func:`kernelgen.runtime.launch.default_num_splits`); for a backward problem, what
    attention_backward() runs (a backward spec, no split count)."""

    spec: AnySpec
    num_splits: int | None = None

    @property
    def label(self) -> str:
        """The spec URI, with ``@<n>splits`` for a fixed split count."""
        return self.spec.uri + (f"@{self.num_splits}splits" if self.num_splits else "")


@dataclass(frozen=True)
class Candidate:
    """A launch that survived pruning (``resources`` is None when NVRTC was unavailable)."""

    spec: AnySpec
    num_splits: int | None = None
    resources: Resources | None = None

    @property
    def launch(self) -> TunedLaunch:
        return TunedLaunch(self.spec, self.num_splits)


@dataclass(frozen=True)
class Dropped:
    """A candidate removed before timing, and why (``uri`` is a readable label if invalid)."""

    uri: str
    stage: str  # "validation" | "occupancy" | "resources" | "model"
    reason: str


def tc_fields(
    warps: int, block_n: int, stages: int, layout: str, rows_per_warp: int = 16, **more: Any
) -> dict[str, Any]:
    """Fields of a tensor-core v2 spec: ``warps`` x ``rows_per_warp`` query rows per tile."""
    return {
        "loop_order": "v2",
        "mma": "mma_sync",
        "block_m": rows_per_warp * warps,
        "block_n": block_n,
        "num_warps": warps,
        "stages": stages,
        "smem_layout": layout,
        **more,
    }


def decode_rows(problem: ProblemDesc) -> int | None:
    """Packed rows of a decode problem (``seqlen_q`` x GQA ratio), None for other problems
    (:func:`kernelgen.model.policy.decode_rows`)."""
    return policy.decode_rows(problem.seqlen_q, problem.gqa_ratio)


def fp8_decode_problem(problem: ProblemDesc) -> bool:
    """An fp8 problem tuned over the decode grid's fp8 forms: a decode step, or a paged cache
    (the fp8 kernels read one with ``fp8_v_layout: kernel`` only)."""
    return problem.fp8 and (decode_rows(problem) is not None or problem.page_size > 0)


def block_n_choices(grid: tuple[int, ...], problem: ProblemDesc) -> tuple[int, ...]:
    """A tensor-core grid's key tiles, plus :data:`PAGED_SMALL_BLOCK_N` for a paged problem
    whose pages no tile of the grid divides."""
    if problem.page_size and all(problem.page_size % n for n in grid):
        return (PAGED_SMALL_BLOCK_N, *grid)
    return grid


def decode_fields(problem: ProblemDesc) -> Iterator[dict[str, Any]]:
    """The split-KV decode grid, and the same tiles without split-KV (one chunk per row tile).

    float32: the CUDA-core kernel with 16-query tiles (no GQA packing there)."""
    rows = decode_rows(problem)
    if rows is None:
        return
    if problem.dtype == "float32":
        for block_n, split in itertools.product(SIMT_BLOCK_N, (True, False)):
            yield {"loop_order": "v2", "block_m": 16, "block_n": block_n, "num_warps": 4,
                   "split_kv": split}  # fmt: skip
        return
    fewest = next((w for w in (1, 2, 4) if 16 * w >= rows), 4)  # beyond 64 rows: 64-row tiles
    layout = default_smem_layout(problem.head_dim)
    for warps in dict.fromkeys((fewest, max(1, fewest // 2))):
        for block_n, stages, split in itertools.product(
            block_n_choices(DECODE_BLOCK_N, problem), DECODE_STAGES, (True, False)
        ):
            if not split and stages != DECODE_STAGES[0]:
                continue  # without splits only a baseline per tile, not a grid
            yield tc_fields(warps, block_n, stages, layout, pack_gqa=True, split_kv=split)


def candidate_fields(problem: ProblemDesc) -> Iterator[dict[str, Any]]:
    """Spec field sets worth trying for ``problem`` (tens, not thousands), best guesses first.

    Decode problems get the decode grid, the prefill default (4 warps x 16 rows: mostly idle
    rows, but no split) and one CUDA-core fallback, not the whole prefill grid."""
    if decode_rows(problem) is not None:
        yield from decode_fields(problem)
        if problem.dtype != "float32":
            head_dim = problem.head_dim
            yield tc_fields(4, policy.default_block_n(head_dim), 2, default_smem_layout(head_dim))
        yield SIMT_FALLBACKS[0]
        return
    if problem.dtype in ("float16", "bfloat16"):
        for (warps, rows), block_n, stages, layout in itertools.product(
            TC_WARP_TILINGS, block_n_choices(TC_BLOCK_N, problem), TC_STAGES, TC_LAYOUTS
        ):
            yield tc_fields(warps, block_n, stages, layout, rows_per_warp=rows)
        yield from SIMT_FALLBACKS
        return
    for block_m, block_n, warps in itertools.product(SIMT_BLOCK_M, SIMT_BLOCK_N, SIMT_WARPS):
        yield {"loop_order": "v2", "block_m": block_m, "block_n": block_n, "num_warps": warps}
    yield SIMT_FALLBACKS[-1]


def simt_backward_fields(problem: ProblemDesc, arch: str) -> Iterator[dict[str, Any]]:
    """The CUDA-core backward grid (every dtype and arch): block_m x block_n x num_warps."""
    for block_m, block_n, warps in itertools.product(
        BACKWARD_SIMT_TILES, BACKWARD_SIMT_TILES, BACKWARD_SIMT_WARPS
    ):
        yield {"mma": "simt", "block_m": block_m, "block_n": block_n, "num_warps": warps}


def tc_backward_fields(problem: ProblemDesc, arch: str) -> Iterator[dict[str, Any]]:
    """The tensor-core backward grid (fp16/bf16 on sm_80 and later): block_m x block_n x
    num_warps x Q/dO stages x split warp roles; the spec drops what does not fit (warp layouts,
    accumulators, split roles' rules, the arch's shared memory)."""
    if problem.dtype not in TC_DTYPES or ARCHS[arch].compute_capability < 80:
        return
    for block_m, block_n, warps, stages, split in itertools.product(
        BACKWARD_TC_TILES, BACKWARD_TC_TILES, BACKWARD_TC_WARPS, BACKWARD_TC_STAGES, (False, True)
    ):
        yield {"mma": "mma_sync", "block_m": block_m, "block_n": block_n, "num_warps": warps,
               "stages": stages, **({"split_roles": True} if split else {})}  # fmt: skip


# One grid per backward engine: its field sets for a backward problem on an arch (an engine
# that does not apply there yields nothing).
BACKWARD_GRIDS: dict[str, Callable[[ProblemDesc, str], Iterator[dict[str, Any]]]] = {
    "simt": simt_backward_fields,
    "mma_sync": tc_backward_fields,
}


def backward_candidate_fields(problem: ProblemDesc, arch: str) -> Iterator[dict[str, Any]]:
    """Spec field sets worth trying for a backward problem on ``arch``: every engine's grid of
    :data:`BACKWARD_GRIDS` in turn. The fields all candidates share (dtype, head dim, causal,
    mask, variants, deterministic: :func:`~kernelgen.tuning.key.spec_fields`) are the caller's."""
    for grid in BACKWARD_GRIDS.values():
        yield from grid(problem, arch)


def wgmma_fields(problem: ProblemDesc, arch: str) -> Iterator[dict[str, Any]]:
    """The Hopper grid, for fp16/bf16 prefill problems on a 9.0 device (``arch`` sm_90) and
    head dims the wgmma kernels take; nothing elsewhere."""
    if (
        arch != HOPPER_DEVICE_ARCH
        or problem.dtype not in ("float16", "bfloat16")
        or problem.head_dim not in WGMMA_HEAD_DIMS
        or decode_rows(problem) is not None
    ):
        return
    yield from wgmma_grid(head_dim=problem.head_dim)


def check_fp8_arch(problem: ProblemDesc, arch: str) -> None:
    """InputError unless ``arch`` is that of a 9.0 device (no kernel runs fp8 elsewhere)."""
    if arch != HOPPER_DEVICE_ARCH:
        raise InputError(
            f"dtype={problem.dtype!r} problems are tuned on compute capability 9.0 devices only "
            f"(arch {HOPPER_DEVICE_ARCH}: the fp8 kernels are sm_90a); this device is {arch}"
        )


def fp8_fields(problem: ProblemDesc, arch: str) -> Iterator[dict[str, Any]]:
    """The fp8 grid (:data:`FP8_LOOPS` at each fp8 tiling of the head dim), for an fp8 problem
    on a 9.0 device (``arch`` sm_90); any other arch raises InputError (no kernel runs fp8
    there)."""
    check_fp8_arch(problem, arch)
    for block_n, (stages, switches) in itertools.product(
        FP8_BLOCK_N_BY_HEAD_DIM.get(problem.head_dim, ()), FP8_LOOPS
    ):
        yield {
            "loop_order": "v2",
            "mma": "wgmma",
            "block_m": 128,
            "block_n": block_n,
            "stages": stages,
            **switches,
            "archs": list(WGMMA_ARCHS),
        }


def wgmma_decode_fields(problem: ProblemDesc, arch: str) -> Iterator[dict[str, Any]]:
    """The Hopper decode grid (:data:`WGMMA_DECODE_BLOCK_N`), for fp16/bf16 decode problems on
    a 9.0 device (``arch`` sm_90) and head dims the wgmma kernels take; nothing elsewhere. An
    fp8 problem (decode, or paged: :func:`fp8_decode_problem`) gets its fp8 forms: V transposed
    in the kernel, the key tiles of :data:`FP8_BLOCK_N_BY_HEAD_DIM` among the grid's."""
    rows = decode_rows(problem)
    if problem.fp8:
        block_ns = tuple(n for n in WGMMA_DECODE_BLOCK_N
                         if n in FP8_BLOCK_N_BY_HEAD_DIM.get(problem.head_dim, ()))  # fmt: skip
        fp8 = {"fp8_v_layout": "kernel"}
        rows = rows if rows is not None else problem.seqlen_q * problem.gqa_ratio
    else:
        block_ns, fp8 = WGMMA_DECODE_BLOCK_N, {}
    if (
        arch != HOPPER_DEVICE_ARCH
        or problem.dtype not in ("float16", "bfloat16", FP8_DTYPE)
        or problem.head_dim not in WGMMA_HEAD_DIMS
        or rows is None
    ):
        return
    block_m = 64 if rows <= 64 else 128
    for block_n, split in itertools.product(block_ns, (True, False)):
        fields = {
            "loop_order": "v2",
            "mma": "wgmma",
            "block_m": block_m,
            "block_n": block_n,
            # fp8 on a paged cache: the untuned choice's stages (policy.fp8_decode_spec)
            "stages": policy.FP8_PAGED_DECODE_STAGES if problem.fp8 and problem.page_size else 2,
            "pack_gqa": block_m % problem.gqa_ratio == 0,
            "split_kv": split,
            **fp8,
            "archs": list(WGMMA_ARCHS),
        }
        yield fields
        # The TMA-store epilogue's twin, as in the prefill grid (docs/hopper.md): the same loop;
        # which epilogue is faster is for a GPU to time.
        yield fields | {"epilogue": "tma"}


def wgmma_grid(
    stages: tuple[int, ...] = WGMMA_STAGES, head_dim: int | None = None
) -> Iterator[dict[str, Any]]:
    """The Hopper grid's field sets (the autotuner's and the benchmark's); with ``head_dim``
    also that head dim's own tilings (:data:`WGMMA_HEAD_DIM_TILINGS`)."""
    own = WGMMA_HEAD_DIM_TILINGS.get(head_dim, ()) if head_dim is not None else ()
    tilings = itertools.chain(
        itertools.product(WGMMA_BLOCK_M, WGMMA_BLOCK_N, stages, WGMMA_OVERLAP),
        ((m, n, stage_count, False) for m, n in WGMMA_WIDE_TILINGS for stage_count in stages),
        ((m, n, stage_count, overlap) for m, n in own for stage_count in stages
         for overlap in WGMMA_OVERLAP),
    )  # fmt: skip
    for block_m, block_n, stage_count, overlap in tilings:
        fields = {
            "loop_order": "v2",
            "mma": "wgmma",
            "block_m": block_m,
            "block_n": block_n,
            "stages": stage_count + 1 if overlap else stage_count,
            "overlap": overlap,
            "archs": list(WGMMA_ARCHS),
        }
        yield fields
        # 2-CTA clusters sharing each K/V tile by multicast, for the 128-row tiles (FlashAttention
        # 3's choice); non-causal problems only: the spec refuses causal, so causal grids drop
        # these twins.
        if block_m == 128:
            yield fields | {"cluster_m": 2}
        if overlap:
            if block_m == 128:  # the overlap with ping-pong: FlashAttention 3's d128 schedule
                yield fields | {"pingpong": True}
            continue
        # The TMA-store epilogue (docs/hopper.md): the same loop, so one twin of the plain loop
        # per tiling; which epilogue is faster is for a GPU to time.
        yield fields | {"epilogue": "tma"}
        if (block_m, block_n) not in WGMMA_WIDE_TILINGS:  # (at d128 they lack the registers)
            # (validation drops it above head dim 128, and wherever the registers are short)
            yield fields | {"q_in_registers": True}  # (where the registers allow)
        if block_m == 128:  # two consumers that may take turns
            yield fields | {"pingpong": True}


def _label(fields: dict[str, Any]) -> str:
    """A readable name for a field set that is not a valid spec (so it has no URI)."""
    return " ".join(f"{k}={v}" for k, v in fields.items())


def pages_per_sequence(problem: ProblemDesc) -> int:
    """Pages one sequence of a paged problem spans (its keys rounded up to whole pages)."""
    return math.ceil(problem.seqlen_k / problem.page_size)


def launch_problem(problem: ProblemDesc, num_splits: int = 1) -> Problem:
    """The kernel-level problem of ``problem`` with contiguous (B, H, S, D) tensors, or for a
    paged problem a pool of (pages, page_size, Hkv, D) pages, ``pages_per_sequence`` per
    sequence (the launch passes seqlens_k = Sk for the last page's padding)."""
    p, d = problem, problem.head_dim
    q_strides = (p.num_heads * p.seqlen_q * d, p.seqlen_q * d, d)
    kv_strides = (p.num_kv_heads * p.seqlen_k * d, p.seqlen_k * d, d)
    paging = {}
    seqlen_k = p.seqlen_k
    if p.page_size:
        pages = pages_per_sequence(p)
        kv_strides = (p.page_size * p.num_kv_heads * d, d, p.num_kv_heads * d)
        seqlen_k = pages * p.page_size
        paging = {
            "page_size": p.page_size,
            "block_table_stride": pages,
            "num_pages": p.batch * pages,
        }
    return Problem(
        batch=p.batch,
        num_heads=p.num_heads,
        num_kv_heads=p.num_kv_heads,
        seqlen_q=p.seqlen_q,
        seqlen_k=seqlen_k,
        head_dim=d,
        q_strides=q_strides,
        k_strides=kv_strides,
        v_strides=kv_strides,
        out_strides=q_strides,
        mask_strides=(0, 0, p.seqlen_k, 1) if p.mask else (0, 0, 0, 0),
        num_splits=num_splits,
        **paging,
    )


def grid_blocks(spec: AnySpec, problem: ProblemDesc, num_splits: int | None = None) -> int:
    """Thread blocks of the main kernel's launch: v2 one per row tile, head and key chunk, v1
    one per head; backward one per key tile and K/V head."""
    if isinstance(spec, BackwardSpec):
        steps = backward.launch_steps(spec, launch_problem(problem))
        return math.prod(next(s.grid for s in steps if s.symbol == spec.uri))
    grid, _ = launch_geometry(spec, launch_problem(problem, num_splits or 1))
    return math.prod(grid)


def heuristic_splits(spec: KernelSpec, problem: ProblemDesc, device: DeviceInfo) -> int:
    """:func:`kernelgen.runtime.launch.default_num_splits` for ``problem`` on ``device`` (its SMs
    and per-SM limits; registers are not known before the offline compile)."""
    return default_num_splits(spec, launch_problem(problem), device.sm_count, device.target_arch)


def split_counts(spec: AnySpec, problem: ProblemDesc, device: DeviceInfo) -> list[int | None]:
    """Split counts to time for a spec: None for one without split-KV (and backward specs);
    else the heuristic's count h, h/2, 2h and 4h, at most one chunk per key tile and
    MAX_SPLITS. (One chunk is the same tiles without split-KV, a candidate of its own.)"""
    if isinstance(spec, BackwardSpec) or not spec.split_kv:
        return [None]
    key_tiles = math.ceil(problem.seqlen_k / spec.block_n)
    h = heuristic_splits(spec, problem, device)
    counts = {min(n, key_tiles, MAX_SPLITS) for n in (max(1, h // 2), h, 2 * h, 4 * h)}
    return sorted(counts)


def valid_candidates(problem: ProblemDesc, arch: str) -> tuple[list[AnySpec], list[Dropped]]:
    """Candidate specs that pass validation for ``arch``, and those that do not (a backward
    problem: backward specs, the call's deterministic flag, mask and variants fixed)."""
    specs: list[AnySpec] = []
    dropped: list[Dropped] = []
    seen: set[str] = set()
    common = {**spec_fields(problem), "archs": [arch]}
    if problem.family == "backward":
        grid = backward_candidate_fields(problem, arch)
    elif problem.fp8:  # the fp8 loops only: no other engine or tiling takes e4m3
        check_fp8_arch(problem, arch)
        decode = fp8_decode_problem(problem)  # the decode grid's fp8 forms
        grid = wgmma_decode_fields(problem, arch) if decode else fp8_fields(problem, arch)
    else:
        grid = itertools.chain(
            wgmma_fields(problem, arch),
            candidate_fields(problem),
            wgmma_decode_fields(problem, arch),
        )
    for fields in grid:
        try:
            spec = spec_of_family({**common, **fields})
        except SpecError as exc:
            dropped.append(Dropped(_label(fields), "validation", "; ".join(exc.problems)))
            continue
        if spec.uri not in seen:
            seen.add(spec.uri)
            specs.append(spec)
    return specs, dropped


def prune_occupancy(
    specs: list[AnySpec], problem: ProblemDesc, device: DeviceInfo
) -> tuple[list[TunedLaunch], list[Dropped]]:
    """The launches of ``specs`` (split-KV specs with :func:`split_counts`), less those whose
    grid has fewer blocks than min(SMs, the most any launch gives)."""
    launches = [TunedLaunch(spec, n) for spec in specs for n in split_counts(spec, problem, device)]
    if not launches:
        return [], []
    blocks = {x: grid_blocks(x.spec, problem, x.num_splits) for x in launches}
    sm_count = device.sm_count
    target = min(sm_count, max(blocks.values()))
    kept, dropped = [], []
    for launch in launches:
        if blocks[launch] < target:
            reason = (
                f"grid has {blocks[launch]} blocks for {sm_count} SMs; other launches give {target}"
            )
            dropped.append(Dropped(launch.label, "occupancy", reason))
        else:
            kept.append(launch)
    return kept, dropped


def prune_resources(
    launches: list[TunedLaunch], arch: str, compile_fn: CompileFn
) -> tuple[list[Candidate], list[Dropped]]:
    """Compile each launch's spec offline (once per spec, on up to :data:`COMPILE_THREADS`
    threads: NVRTC releases the GIL); drop failures and kernels that spill or use a stack."""
    kept: list[Candidate] = []
    dropped: list[Dropped] = []
    specs = list({x.spec.uri: x.spec for x in launches}.values())
    workers = max(1, min(len(specs), COMPILE_THREADS))
    with ThreadPoolExecutor(workers) as pool:
        found = pool.map(lambda spec: _resource_verdict(spec, arch, compile_fn), specs)
        verdicts = dict(zip((s.uri for s in specs), found, strict=True))  # uri -> why not, or res
    for launch in launches:
        spec = launch.spec
        verdict = verdicts[spec.uri]
        if isinstance(verdict, str):
            dropped.append(Dropped(launch.label, "resources", verdict))
        else:
            kept.append(Candidate(spec, launch.num_splits, verdict))
    return kept, dropped


def _resource_verdict(spec: AnySpec, arch: str, compile_fn: CompileFn) -> Resources | str:
    """ptxas' resources for ``spec``, or why it is disqualified."""
    try:
        res = compile_fn(spec, spec.compile_arch(arch))
    except (ToolchainMissingError, SettingError):  # the machine's problem, not the candidate's
        raise
    except (KernelgenError, ValueError) as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        return f"offline compile failed: {first}"
    return "; ".join(static_problems(spec, res)) or res  # spills, stack, local memory


MODEL_TOP_K = 8  # prefill tensor-core candidates timed, the static model's best first


def modelled(spec: AnySpec) -> bool:
    """Whether the static model ranks ``spec``: forward tensor-core specs without split-KV
    (not backward specs: the model has no backward pass)."""
    return isinstance(spec, KernelSpec) and spec.engine.modelled and not spec.split_kv


def prune_by_model(
    launches: list[Any], arch: str, top_k: int = MODEL_TOP_K
) -> tuple[list[Any], list[Dropped]]:
    """Order the prefill tensor-core launches (TunedLaunch or Candidate) by the static model's
    predicted cost per unit (kernelgen.model.perfmodel.analytic_cost: shared-memory traffic, tensor
    and MUFU bounds) and keep the best ``top_k``, as Triton's ``prune_configs_by={'perf_model',
    'top_k'}``; the others (CUDA-core fallbacks, split-KV decode launches) are kept in order."""
    from kernelgen.model.perfmodel import analytic_cost

    ranked_ones = [x for x in launches if modelled(x.spec)]
    cost = {id(x): analytic_cost(x.spec, arch) for x in ranked_ones}
    ranked = sorted(ranked_ones, key=lambda x: cost[id(x)])
    dropped = [
        Dropped(
            TunedLaunch(x.spec, x.num_splits).label,
            "model",
            f"predicted {cost[id(x)]:.0f} clk/unit, rank {rank + 1} > top {top_k}",
        )
        for rank, x in enumerate(ranked)
        if rank >= top_k
    ]
    kept = ranked[:top_k] + [x for x in launches if all(x is not m for m in ranked_ones)]
    return kept, dropped


def prune(
    problem: ProblemDesc, device: DeviceInfo, compile_fn: CompileFn | None = None
) -> tuple[list[Candidate], list[Dropped]]:
    """Candidates for ``problem`` on ``device`` after every static check, and the drops (a
    backward problem: no model stage; every valid spec that fills the GPU is compiled).

    ``compile_fn`` defaults to :func:`offline_resources`; without NVRTC the resource check is
    skipped with a warning (the kernels are still compiled, by CuPy, before timing)."""
    arch = device.target_arch
    specs, dropped = valid_candidates(problem, arch)
    launches, more = prune_occupancy(specs, problem, device)
    dropped += more
    # Compile (offline, for the spill check) only the model's 2 top_k best; the best top_k of
    # those that pass are timed.
    launches, more = prune_by_model(launches, arch, 2 * MODEL_TOP_K)
    dropped += more
    try:
        kept, more = prune_resources(launches, arch, compile_fn or offline_resources)
    except ToolchainMissingError as exc:
        log.warning("skipping the spill/stack check (%s)", exc)
        kept, more = [Candidate(x.spec, x.num_splits) for x in launches], []
    dropped += more
    kept, more = prune_by_model(kept, arch)
    dropped += more
    for d in dropped:
        log.info("dropped %s [%s]: %s", d.uri, d.stage, d.reason)
    return kept, dropped


# ---- memoized offline compile -------------------------------------------------------------
_RESOURCES: dict[tuple[str, str], Resources] = {}


@cache
def _nvrtc_version() -> str:
    from kernelgen.kernels.compile import _nvrtc

    _, major, minor = _nvrtc().nvrtcVersion()
    return f"{major}.{minor}"


def _memo_path(spec: AnySpec, arch: str) -> Path:
    """``<cache dir>/resources/<uri>-<arch>-<digest>.json``: the digest covers the spec, the
    arch, the template hash, kernelgen's version and NVRTC's. The cubin sits beside it."""
    from kernelgen.kernels.render import template_hash
    from kernelgen.tuning.db import cache_dir
    from kernelgen.version import __version__

    identity = [spec.canonical_json(), arch, template_hash(), __version__, _nvrtc_version()]
    return cache_dir() / "resources" / f"{spec.uri}-{arch}-{canonical_digest(identity)[:16]}.json"


def offline_resources(spec: AnySpec, arch: str) -> Resources:
    """ptxas' resource report for ``spec`` on ``arch`` (a backward spec: of its kernel set,
    :func:`kernel_set_resources`), memoized in process and on disk, with the compiled cubin
    kept beside the report (:func:`offline_cubin`); an unreadable entry is recompiled."""
    from kernelgen.families import render_any
    from kernelgen.kernels.compile import compile_offline

    memo_key = (spec.canonical_json(), arch)
    if memo_key in _RESOURCES:
        return _RESOURCES[memo_key]
    path = _memo_path(spec, arch)
    res = _read_resources(path)
    if res is None:
        compiled = compile_offline(render_any(spec), spec.uri, arch, sass=False)
        res = compiled.resources
        if isinstance(spec, BackwardSpec):
            res = kernel_set_resources(compiled.log, backward.symbols(spec), arch)
        try:  # the cubin first: a report on disk promises its cubin
            atomic_write_bytes(path.with_suffix(".cubin"), compiled.cubin)
            atomic_write_text(path, json.dumps(res.as_dict(), sort_keys=True))
        except OSError as exc:
            log.debug("cannot memoize resources in %s: %s", path, exc)
    _RESOURCES[memo_key] = res
    return res


def kernel_set_resources(log: str, symbols: list[str], arch: str) -> Resources:
    """One report for the kernels ``symbols`` of one source (a backward spec's preprocess, main
    and dQ kernels): the most registers, spill, stack and static shared-memory bytes of any, so
    that a spill in any kernel disqualifies the spec."""
    reports = [parse_ptxas_report(log, symbol, arch) for symbol in symbols]
    return Resources(
        arch,
        max(r.registers for r in reports),
        max(r.spill_store_bytes for r in reports),
        max(r.spill_load_bytes for r in reports),
        max(r.stack_bytes for r in reports),
        max(r.static_smem_bytes for r in reports),
    )


def offline_cubin(spec: AnySpec, arch: str) -> Path | None:
    """The cubin :func:`offline_resources` compiled for ``spec`` on ``arch``, if on disk (the
    tuner loads it instead of compiling the spec a second time)."""
    try:
        path = _memo_path(spec, arch).with_suffix(".cubin")
    except ToolchainMissingError:  # no offline NVRTC: nothing was compiled offline
        return None
    return path if path.is_file() else None


def clear_resource_memo() -> None:
    """Forget the in-process resource reports (the disk memo stays)."""
    _RESOURCES.clear()


def _read_resources(path: Path) -> Resources | None:
    if not os.path.exists(path):
        return None
    try:
        return Resources(**json.loads(path.read_text()))
    except (OSError, ValueError, TypeError) as exc:
        log.warning("ignoring unreadable compile memo %s: %s", path, exc)
        return None
