"""Launch policy: the spec a call runs without tuning (:func:`default_spec`) and when a call is a
decode step (:func:`decode_rows`). Below both the tuner (its candidates and heuristic) and the
API, so each reads it without importing the other."""

from __future__ import annotations

from typing import Any, NamedTuple

from kernelgen.errors import InputError
from kernelgen.specs.arch import ARCHS
from kernelgen.specs.backward import BackwardSpec
from kernelgen.specs.forward import (
    FP8_BLOCK_N_BY_HEAD_DIM,
    FP8_DTYPE,
    FP8_HEAD_DIMS,
    WGMMA_ARCHS,
    WGMMA_HEAD_DIMS,
    KernelSpec,
    SmemLayout,
    default_smem_layout,
    normalize_dtype,
)

DECODE_MAX_ROWS = 64  # packed rows (seqlen_q x query heads per K/V head) of one decode tile
DECODE_MAX_SEQLEN_Q = 16  # queries per sequence of a decode step, whatever the GQA ratio


def decode_rows(seqlen_q: int, group: int) -> int | None:
    """Packed rows (``seqlen_q`` x ``group`` query heads per K/V head) when a call is a decode
    step, None otherwise: at most :data:`DECODE_MAX_ROWS` rows (one tile per K/V head), or any
    number of rows with at most :data:`DECODE_MAX_SEQLEN_Q` queries (64-row tiles, each reading
    the K/V head once, instead of one mostly idle tile per query head)."""
    rows = seqlen_q * group
    return rows if rows <= DECODE_MAX_ROWS or seqlen_q <= DECODE_MAX_SEQLEN_Q else None


def default_block_n(head_dim: int) -> int:
    """Key tile of the untuned tensor-core spec: 64 keys, 32 above head dim 128 (registers)."""
    return 64 if head_dim <= 128 else 32


class Tiling(NamedTuple):
    """The tile shape of a tensor-core spec (smem_layout None: the head dim's default layout)."""

    block_m: int
    block_n: int
    num_warps: int = 4
    smem_layout: SmemLayout | None = None


# Where the untuned prefill spec gives each warp 32 query rows, per arch: (largest head dim,
# tiling) steps. Each is the static model's best tiling for its head dims that compiles without
# spills in both dtypes, causal or not (kernelgen.model.perfmodel; docs/performance-model.md; the
# compile tier checks the ends of each range): 4 warps x 32 rows with 64-key tiles up to head
# dim 80, then 8 warps x 32 rows: 64-key tiles to 96 (68 KiB of shared-memory traffic per unit
# against 74 KiB for 128 x 64), 48-key tiles to 128 (93 KiB at head dim 128 against 112 KiB for
# 128 x 32; its ldmatrix addresses need the padded layout to fit 255 registers). Measured on an
# H100 (bench/NOTES.md, 2026-11-26, bf16 d128 4k), that 8-warp 256 x 48 tiling ran 17 % below
# the 4-warp 128 x 48 one (319 against 383 TFLOP/s; causal 268 against 323), which the model
# ranks lower: sm_90 takes the measured tiling above head dim 96, sm_80 (not measured) the
# model's.
_WIDE_TO_96 = ((80, Tiling(128, 64)), (96, Tiling(256, 64, 8, "padded")))
WIDE_TILES: dict[str, tuple[tuple[int, Tiling], ...]] = {
    "sm_80": (*_WIDE_TO_96, (128, Tiling(256, 48, 8, "padded"))),
    "sm_90": (*_WIDE_TO_96, (128, Tiling(128, 48, 4, "padded"))),
}
# Kernels with more live state than the plain ones (the built-in variants, user expressions)
# spill in the 8-warp tiling at head dim 128 and, with every variant, in 64-key tiles at 96:
# they keep 4 warps, 64-key tiles to head dim 80 (checked the same way).
RICH_WIDE_TILES: dict[str, tuple[tuple[int, Tiling], ...]] = {
    "sm_90": ((80, Tiling(128, 64)), (128, Tiling(128, 32))),
    "sm_80": ((80, Tiling(128, 64)), (128, Tiling(128, 32))),
}
# Kernels that read an additive mask (its row addressing holds registers across the loop).
MASKED_WIDE_TILES: dict[str, tuple[tuple[int, Tiling], ...]] = {
    "sm_90": ((80, Tiling(128, 64)), (128, Tiling(128, 32))),
    "sm_80": ((80, Tiling(128, 32)),),
}


# Above the tables' head dims a warp holds 16 rows (32 rows of a 136- to 256-wide head are 168 to
# 288 accumulators per thread): 8 warps and 48-key tiles (head dim 256: 331 KiB of shared-memory
# traffic per unit against 384 KiB for 64 x 32 with 4 warps). The block's shared memory fits
# sm_80's 163 KiB at every head dim (at most 320 rows of 256 elements, swizzled, or 248 padded).
LARGE_HEAD_TILING = Tiling(128, 48, 8)


def default_tiling(
    head_dim: int, archs: tuple[str, ...], additive_mask: bool = False, lean: bool = True
) -> Tiling:
    """Tiles of the untuned prefill tensor-core spec for ``archs``: 32 rows per warp
    (:data:`WIDE_TILES`; :data:`RICH_WIDE_TILES` unless the kernel is ``lean``, i.e. has no
    variant or expression; :data:`MASKED_WIDE_TILES` for a kernel that reads an additive mask)
    where every arch allows it (the narrower one where they differ); above
    every range, :data:`LARGE_HEAD_TILING` (8 warps of 16 rows); for other archs 16 rows per
    warp (64 x :func:`default_block_n`, 4 warps)."""
    table = MASKED_WIDE_TILES if additive_mask else WIDE_TILES if lean else RICH_WIDE_TILES
    steps = [
        next((tiling for limit, tiling in table.get(arch, ()) if head_dim <= limit), None)
        for arch in archs
    ]
    if steps and None not in steps:
        # archs that differ: the narrower tiling (fewer rows per warp, then fewer keys)
        return min(steps, key=lambda t: (t.block_m // t.num_warps, t.block_n))  # type: ignore[union-attr]
    widest = max(limit for arch_steps in WIDE_TILES.values() for limit, _ in arch_steps)
    if archs and head_dim > widest and all(arch in WIDE_TILES for arch in archs):
        return LARGE_HEAD_TILING
    return Tiling(64, default_block_n(head_dim))


def default_spec(
    dtype: str,
    head_dim: int,
    causal: bool,
    arch: str | None = None,
    *,
    tensor_cores: bool = True,
    decode_rows: int | None = None,
    split_kv: bool | None = None,
    paged_kv: bool = False,
    variants: tuple[str, ...] = (),
    additive_mask: bool = False,
    expressions: bool = False,
) -> KernelSpec:
    """A sensible spec for a shape until the autotuner chooses.

    float16/bfloat16 (with ``tensor_cores``): the mma.sync v2 kernel, two stages, tiles from
    :func:`default_tiling` (on sm_80 and sm_90, 32 rows per warp up to head dim 128: 4 warps
    and 64 keys up to head dim 80, then 8 warps with 64 keys to 96 and 48 keys to 128 for plain
    kernels; 8 warps of 16 rows above; other archs 4 warps of 16 rows), swizzled where the head
    dim allows unless the tiling says otherwise. With
    ``decode_rows`` (a decode step's packed rows, :func:`decode_rows`): the decode kernel
    instead, GQA heads packed into the rows of the tiles, split-KV, as few warps as hold the
    rows (4 beyond 64 rows). ``split_kv`` True/False forces split-KV on or off (None: decode
    shapes only). Otherwise the CUDA-core v2 kernel with the largest tiles that fit (decode
    shapes: 16-row tiles and split-KV as well). ``dtype`` takes the short names too (bf16,
    fp16, f16, half, fp32, f32, float); any other raises InputError naming the allowed ones.
    ``paged_kv``: K and V in a paged cache (the same tiling, paged addressing).
    ``variants``: the built-in variants (spec flags, e.g. ``("window", "sinks")``) to compile in.
    ``additive_mask``: the call has a mask (a kernel that reads one; its tiles from
    :data:`MASKED_WIDE_TILES`). ``expressions``: the caller adds user expressions to the spec
    (their kernels take :data:`RICH_WIDE_TILES`, as do those with ``variants``).
    ``dtype="float8_e4m3"``: :func:`fp8_default_spec`, the plain-loop fp8 kernel with
    ``variants`` (``expressions`` changes nothing: the caller adds them; a decode form, split-KV,
    a paged cache or a mask raises InputError).
    """
    if dtype == FP8_DTYPE:
        options = {"decode_rows": decode_rows, "split_kv": split_kv, "paged_kv": paged_kv,
                   "additive_mask": additive_mask}  # fmt: skip
        for name, value in options.items():
            if value not in (None, False, ()):
                raise InputError(
                    f"{name}={value!r} is not allowed with dtype={FP8_DTYPE!r}; the fp8 kernel "
                    "is the prefill forward (docs/hopper.md, fp8)"
                )
        return fp8_default_spec(head_dim, causal, variants)
    dtype = normalize_dtype(dtype)
    archs = (arch,) if arch in ARCHS else ("sm_80", "sm_90")
    decode = decode_rows is not None
    split = decode if split_kv is None else bool(split_kv)
    causal = bool(causal)
    flags = {name: True for name in variants}
    if additive_mask:
        flags["additive_mask"] = True
    if tensor_cores and dtype in ("float16", "bfloat16"):
        tiling = default_tiling(head_dim, archs, additive_mask, lean=not (variants or expressions))
        if decode_rows is not None:
            warps = next((w for w in (1, 2, 4) if 16 * w >= decode_rows), 4)
            tiling = Tiling(16 * warps, default_block_n(head_dim), warps)
        return KernelSpec(
            loop_order="v2",
            dtype=dtype,
            head_dim=head_dim,
            block_m=tiling.block_m,
            block_n=tiling.block_n,
            num_warps=tiling.num_warps,
            causal=causal,
            mma="mma_sync",
            smem_layout=tiling.smem_layout or default_smem_layout(head_dim),
            pack_gqa=decode,
            split_kv=split,
            paged_kv=paged_kv,
            archs=archs,
            **flags,
        )
    block_m = 16 if decode else 64 if head_dim <= 128 else 32
    for block_n in (32, 16):
        try:
            return KernelSpec(
                loop_order="v2",
                dtype=dtype,
                head_dim=head_dim,
                block_m=block_m,
                block_n=block_n,
                num_warps=4,
                causal=causal,
                split_kv=split,
                paged_kv=paged_kv,
                archs=archs,
                **flags,
            )
        except ValueError:
            continue
    raise InputError(f"no default kernel fits head_dim={head_dim}, dtype={dtype} on {archs}")


# The Hopper (wgmma) kernel without tuning, on compute capability 9.0 devices: measured on an
# H100 (bench/NOTES.md, 2026-11-26) at 1.24-1.81x the mma.sync kernel's best tiling, bf16 4k,
# head dims 64-256. Two consumer warpgroups (128 query rows) always won; 128-key tiles at head
# dims 64 and 128 (d128: 560 against 568 TFLOP/s for 64-key tiles, within the noise; causal
# 497 against 485; and 820 against 1000 instructions per unit), 64-key tiles at 96 (not
# measured) and 256 (the only ones that fit); the plain loop, without ping-pong. Q in registers
# with 64-key tiles, and at d128 x 128 keys only since its fix (below): on an H100
# (bench/results/2026-11-26-*-run5-session.json, bf16 d128 4k) it ran 0.97x the same 128-key
# tiling with Q from shared memory (633.1 against 649.8 TFLOP/s; causal 0.96x, and 0.90-0.98x
# in run 4; run 6 on another H100: 1.03x, causal 0.95x; run 8: 0.98x, causal 0.97x, and fp16
# 16k 1.01x, causal 0.94x),
# though it takes the unit from 56 to 48 KiB of traffic, while at 64-key tiles, where Q is
# re-read twice as often, it ran 1.02-1.05x. The overlapped loop (overlap: true, 3 stages) ran
# 1.01x the plain loop without causality and 0.99x with it: not the default either.
# Key tiles of the untuned default by head dim: 128 where it fits and was measured best, 64 at
# 96 (not measured) and 256 (the only ones that fit); at 192 (added 2026-11-27, not measured)
# 96, the model's choice: 128 keys do not fit in shared memory, and with 64 the operand reads
# bind (96 KiB per unit, 1030 instructions) where 96 keys leave the tensor term binding (88 KiB,
# 895 instructions).
# Why Q in registers lost at d128 x 128 keys, found offline (2026-11-27, sixth session): the
# H100 runs compiled with NVRTC 13.2, whose SASS of the plain kernel matches run 8's ncu page
# instruction for instruction. In its Q-in-registers kernel each Q K^T product waited on a K
# descriptor built between the products (about 9 cycles each, 8 per tile): per two tiles the
# loop held 27 more instructions and 1.9 % more encoded stall cycles than the plain loop (2.3 %
# causal), and run 8's ncu measured 2.6 % more cycles and 4.8 % more executed instructions.
# With the descriptors built once before the loop ("K's descriptors" in docs/hopper.md; the
# schedule check holds every Q-in-registers spec to it) the loop is 14 instructions shorter
# than the plain one and 0.4 % below its stall cycles (0.8 % causal), at 48 KiB per unit
# against 56. So the default holds Q in registers at d128 x 128 keys without causality, where
# the measured loss (0.97-0.98x in runs 5 and 8, 1.03x in run 6) is what the descriptors
# explain; causal calls keep Q in shared memory until a GPU times the fix: their loss at fp16
# 16k (0.90x, 0.94x) was larger than the descriptors explain.
HOPPER_DEFAULT_BLOCK_N: dict[int, int] = {64: 128, 96: 64, 128: 128, 192: 96, 256: 64}
Q_IN_REGISTERS_BLOCK_N = 64  # the key tile up to which the default holds Q in registers
Q_IN_REGISTERS_MAX_HEAD_DIM = 128  # where its head_dim / 4 registers fit
HOPPER_DEVICE_ARCH = "sm_90"  # the device arch that runs sm_90a code (wgmma: 9.0 only)
# Head dims whose default holds Q in registers at any key tile when the call is not causal.
Q_IN_REGISTERS_NONCAUSAL_HEAD_DIMS = (128,)


def default_q_in_registers(head_dim: int, block_n: int, causal: bool) -> bool:
    """Whether the untuned wgmma spec holds Q in registers: up to head dim 128 at key tiles up
    to 64 (where Q is re-read most), and at d128 without causality (above)."""
    if head_dim > Q_IN_REGISTERS_MAX_HEAD_DIM:
        return False
    return block_n <= Q_IN_REGISTERS_BLOCK_N or (
        not causal and head_dim in Q_IN_REGISTERS_NONCAUSAL_HEAD_DIMS
    )


def hopper_default_spec(
    dtype: str,
    head_dim: int,
    causal: bool,
    variants: tuple[str, ...] = (),
    tiles: tuple[int, int] | None = None,
) -> KernelSpec | None:
    """The untuned wgmma spec of a prefill problem on a 9.0 device, or None where the wgmma
    kernels do not apply (fp32, a head dim they do not take, a variant they do not compile).
    ``tiles``: the (block_m, block_n) a block-sparse call's block mask was built in, which the
    kernel must take (None where no wgmma kernel takes them: block_m other than 64 or 128, a
    key tile that is no multiple of 16 from 32 to 256 or does not fit the registers; the call
    then runs the mma.sync kernel in those tiles); Q in registers where
    :func:`default_q_in_registers` says."""
    dtype = normalize_dtype(dtype)
    if dtype not in ("float16", "bfloat16") or head_dim not in WGMMA_HEAD_DIMS:
        return None
    block_m, block_n = tiles or (128, HOPPER_DEFAULT_BLOCK_N[head_dim])
    q_in_registers = default_q_in_registers(head_dim, block_n, bool(causal))
    # Q in registers first where the rule says so, then from shared memory: a block mask's key
    # tile may leave no registers for Q (e.g. 176 keys at d128)
    for q_held in dict.fromkeys((q_in_registers, False)):
        try:
            return _hopper_spec(
                dtype, head_dim, causal, block_m, block_n, q_in_registers=q_held,
                **{name: True for name in variants},
            )  # fmt: skip
        except ValueError:  # a variant or tiles the wgmma kernels do not compile
            continue
    return None


def _hopper_spec(
    dtype: str, head_dim: int, causal: bool, block_m: int, block_n: int, **fields: Any
) -> KernelSpec:
    """A wgmma forward spec of the policy's (16-bit or fp8): the v2 loop, 2 stages, sm_90a."""
    return KernelSpec(
        loop_order="v2",
        mma="wgmma",
        dtype=dtype,
        head_dim=head_dim,
        block_m=block_m,
        block_n=block_n,
        stages=2,
        causal=bool(causal),
        archs=WGMMA_ARCHS,
        **fields,
    )


def fp8_default_spec(head_dim: int, causal: bool, variants: tuple[str, ...] = ()) -> KernelSpec:
    """The untuned spec of an fp8 (e4m3) call without one: the plain-loop wgmma forward at the
    head dim's first key tile of :data:`~kernelgen.specs.forward.FP8_BLOCK_N_BY_HEAD_DIM`
    (specs/v2_wg_e4m3_d{64,128,256}_m128_n*_s2.yaml and causal twins; d96 and d192, which ship
    no spec file: 128-key tiles, the model's best at d192), for calls on the CPU
    backend and with ``KERNELGEN_AUTOTUNE=0``; a GPU call otherwise runs the tuner's choice
    among the fp8 loops (docs/autotuning.md). ``variants``: the built-in variants (spec flags,
    e.g. ``("window", "softcap")``) to compile in. Raises InputError for a head dim other than
    :data:`~kernelgen.specs.forward.FP8_HEAD_DIMS`."""
    if head_dim not in FP8_HEAD_DIMS:
        raise InputError(
            f"head_dim={head_dim} is not allowed with float8_e4m3 inputs; use "
            f"{' or '.join(map(str, FP8_HEAD_DIMS))} (other head dims: not built yet)"
        )
    return _hopper_spec(
        FP8_DTYPE, head_dim, causal, 128, FP8_BLOCK_N_BY_HEAD_DIM[head_dim][0],
        **{name: True for name in variants},
    )  # fmt: skip


# Stages of an fp8 decode spec on a paged cache (the policy's and the tuner's): see
# fp8_decode_spec for why 3.
FP8_PAGED_DECODE_STAGES = 3


def fp8_decode_spec(
    head_dim: int,
    causal: bool,
    group: int,
    variants: tuple[str, ...] = (),
    *,
    paged_kv: bool = False,
) -> KernelSpec:
    """The spec of an fp8 (e4m3) decode call without one (``attention_with_kvcache`` on an fp8
    cache; specs/v2_wg_e4m3_d128_m64_n128_s2_vk_gqa_split.yaml at d128): the wgmma forward
    reading the cache in place (``fp8_v_layout: kernel``, V transposed in shared memory),
    split-KV, one consumer warpgroup of 64 rows, packed GQA where the group divides them, the
    head dim's first fp8 key tile (``paged_kv``: a paged cache, 64-key tiles, so pages of a
    multiple of 64 keys are one TMA copy per tile, other multiples of 16 row copies by
    cp.async), 2 stages, 3 with ``paged_kv``. The untuned choice (the tuner's heuristic for fp8
    decode and paged problems; docs/hopper.md, "fp8 decode").

    Why 3 stages on a paged cache: with row copies the producer's 128 threads both copy and
    transpose, and a thread transposes tile t - 1 only after its wait for tile t's free slot.
    With 2 stages that slot is freed when the consumers finish tile t - 2, so every transpose
    runs between two tiles' products instead of beside them (run 8: 0.66-0.75x the contiguous
    fp8 call's bandwidth on 16-key pages). With 3 it waits for tile t - 3, and the transpose of
    t - 1 overlaps the products of t - 2."""
    base = fp8_default_spec(head_dim, causal, variants)
    return KernelSpec(
        **{
            **base.model_dump(),
            "block_m": 64,
            "num_warps": 8,
            "split_kv": True,
            "pack_gqa": group > 1 and 64 % group == 0,
            "fp8_v_layout": "kernel",
            "paged_kv": paged_kv,
            "block_n": 64 if paged_kv else base.block_n,
            "stages": FP8_PAGED_DECODE_STAGES if paged_kv else base.stages,
        }
    )


def hopper_decode_spec(
    dtype: str,
    head_dim: int,
    causal: bool,
    decode_rows: int,
    group: int,
    *,
    paged_kv: bool = False,
) -> KernelSpec | None:
    """The wgmma decode spec of a 9.0 device (what the benchmark's ``kg-decode-wg`` runs; the
    autotuner's Hopper decode grid holds it among its candidates), or None where the wgmma
    kernels do not apply. Not the untuned decode default: that stays the mma.sync split-KV spec
    until a GPU has timed this one (docs/hopper.md, "Decode and serving").

    Packed GQA where the group divides block_m (a TMA box holds whole queries), split-KV, one
    consumer warpgroup up to 64 packed rows (two past them), 128-key tiles at head dims 64
    and 128 (64 at 96 and 256, or with a paged cache: pages of a multiple of 64 keys are then
    one TMA copy per tile, smaller ones are copied row by row with cp.async), 2 stages."""
    dtype = normalize_dtype(dtype)
    if dtype not in ("float16", "bfloat16") or head_dim not in WGMMA_HEAD_DIMS:
        return None
    block_m = 64 if decode_rows <= 64 else 128
    block_n = 128 if head_dim in (64, 128) and not paged_kv else 64
    return _hopper_spec(
        dtype, head_dim, causal, block_m, block_n,
        pack_gqa=block_m % group == 0, split_kv=True, paged_kv=paged_kv,
    )  # fmt: skip


# The untuned tensor-core backward, by padded head dim: (largest, block_m, block_n, num_warps,
# stages, split_roles). Each is the tiling the static model ranks first among those that compile
# without spills (docs/performance-model.md, "Backward (tensor cores)"): up to head dim 128, 128-key
# blocks of 8 warps with split roles (per 32 keys, a P warp for S^T, P^T, dV and dQ and a dS warp
# for dP^T, dS^T and dK, each over the whole 64-query tile: 128 dK or dV accumulators per thread
# at head dim 128), two Q/dO stages; above head dim 128, 64-key blocks whose 8 warps split the head
# dim four ways, one stage (two spill at head dim 192 on sm_80).
BACKWARD_TC_TILES = ((128, 64, 128, 8, 2, True), (256, 64, 64, 8, 1, False))
# Kernels with more live state in their exact tiles (the built-in variants, an additive mask,
# user expressions) spill in the 128-key tiling at head dim 128: 64-key blocks (a 2 x 4 grid),
# also the fallback where an arch's shared memory is too small for the first (sm_86, sm_89).
BACKWARD_TC_RICH_TILES = (
    (64, 64, 128, 8, 2, False),
    (128, 64, 64, 8, 2, False),
    (256, 64, 64, 8, 1, False),
)


def default_backward_spec(
    dtype: str,
    head_dim: int,
    *,
    causal: bool,
    variants: tuple[str, ...] = (),
    expressions: Any = None,
    deterministic: bool = False,
    tensor_cores: bool = True,
    additive_mask: bool = False,
    arch: str | None = None,
) -> BackwardSpec:
    """The backward spec for a call, with the call's variants and expressions and, with
    ``additive_mask``, the mask flag (which also picks the tiling).

    float16/bfloat16 with ``tensor_cores`` (sm_80+, q, k, v and dout copyable in 16-byte
    chunks): the mma.sync engine with :data:`BACKWARD_TC_TILES`, or :data:`BACKWARD_TC_RICH_TILES`
    for kernels with variants, a mask or expressions, fitting ``arch`` (a device's) or else
    sm_80 and sm_90: the table's Q/dO stages, else one, else the rich tiling (sm_86, sm_89:
    99 KiB), else the CUDA-core engine. Otherwise the CUDA-core family with 32 x 32 tiles
    (16 x 16 above head dim 128, where 32 keys would give each of 128 threads more than 128 dK
    and dV accumulators), 4 warps."""
    fields: dict[str, Any] = {
        "family": "backward",
        "dtype": dtype,
        "head_dim": head_dim,
        "causal": causal,
        "deterministic": deterministic,
        "additive_mask": additive_mask,
        **{name: True for name in variants},
    }
    if arch in ARCHS:
        fields["archs"] = (arch,)
    if expressions is not None:  # with a mask_mod: block-sparse (lists built per call)
        fields.update(expressions.spec_fields())
        fields["block_sparse"] = expressions.mask_mod is not None
    if tensor_cores and normalize_dtype(dtype) in ("float16", "bfloat16"):
        padded = -(-head_dim // 16) * 16
        rich = bool(variants) or additive_mask or (expressions is not None and expressions.present)
        tables = (BACKWARD_TC_RICH_TILES,) if rich else (BACKWARD_TC_TILES, BACKWARD_TC_RICH_TILES)
        for table in tables:
            _, block_m, block_n, warps, most, split = next(t for t in table if padded <= t[0])
            for stages in range(most, 0, -1):
                try:
                    return BackwardSpec(
                        **fields, mma="mma_sync", block_m=block_m, block_n=block_n,
                        num_warps=warps, stages=stages, split_roles=split,
                    )  # fmt: skip
                except ValueError:  # over the arch's shared memory
                    continue
    tile = 32 if head_dim <= 128 else 16
    return BackwardSpec(**fields, block_m=tile, block_n=tile, num_warps=4)
