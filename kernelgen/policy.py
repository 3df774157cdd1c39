"""Launch policy: the spec a call runs without tuning (:func:`default_spec`) and when a call is a
decode step (:func:`decode_rows`). Below both the tuner (its candidates and heuristic) and the
API, so each reads it without importing the other."""

from __future__ import annotations

from kernelgen.arch import ARCHS
from kernelgen.errors import InputError
from kernelgen.spec import KernelSpec, default_smem_layout, normalize_dtype

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


# Where the untuned prefill spec gives each warp 32 query rows (block_m 128 with 4 warps), per
# arch: (largest head dim, block_n) steps. It is the static model's best tiling
# (kernelgen.perfmodel: it halves the K/V re-reads of 16-row warps; docs/performance-model.md),
# measured fastest on an H100 (bench/NOTES.md), and free of spills in both dtypes, causal or
# not, at every head dim of its range (the compile tier checks samples of each range). The
# ranges are the same on both archs since kernels without an additive mask hold no register for
# it (spec.additive_mask); 64-key tiles spill from head dim 104 (192 accumulators at 128).
WIDE_TILES: dict[str, tuple[tuple[int, int], ...]] = {
    "sm_90": ((96, 64), (128, 32)),
    "sm_80": ((96, 64), (128, 32)),
}
# The same for kernels that read an additive mask (its row addressing holds registers across
# the loop; checked the same way).
MASKED_WIDE_TILES: dict[str, tuple[tuple[int, int], ...]] = {
    "sm_90": ((80, 64), (128, 32)),
    "sm_80": ((80, 32),),
}


def default_tiling(
    head_dim: int, archs: tuple[str, ...], additive_mask: bool = False
) -> tuple[int, int]:
    """(block_m, block_n) of the untuned 4-warp prefill tensor-core spec for ``archs``: 32 rows
    per warp (:data:`WIDE_TILES`, :data:`MASKED_WIDE_TILES` for a kernel that reads an additive
    mask) where every arch allows it, else 16 rows per warp (64 x :func:`default_block_n`)."""
    table = MASKED_WIDE_TILES if additive_mask else WIDE_TILES
    steps = [
        next((n for limit, n in table.get(arch, ()) if head_dim <= limit), None) for arch in archs
    ]
    if steps and None not in steps:
        return 128, min(steps)
    return 64, default_block_n(head_dim)


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
) -> KernelSpec:
    """A sensible spec for a shape until the autotuner chooses.

    float16/bfloat16 (with ``tensor_cores``): the mma.sync v2 kernel, 4 warps, two stages,
    swizzled where the head dim allows, tiles from :func:`default_tiling` (32 rows per warp on
    sm_80 and sm_90 up to head dim 128, with 64 keys up to head dim 96; else 16 rows and 64 keys,
    32 above head dim 128). With
    ``decode_rows`` (a decode step's packed rows, :func:`decode_rows`): the decode kernel
    instead, GQA heads packed into the rows of the tiles, split-KV, as few warps as hold the
    rows (4 beyond 64 rows). ``split_kv`` True/False forces split-KV on or off (None: decode
    shapes only). Otherwise the CUDA-core v2 kernel with the largest tiles that fit (decode
    shapes: 16-row tiles and split-KV as well). ``dtype`` takes the short names too (bf16,
    fp16, f16, half, fp32, f32, float); any other raises InputError naming the allowed ones.
    ``paged_kv``: K and V in a paged cache (the same tiling, paged addressing).
    ``variants``: the built-in variants (spec flags, e.g. ``("window", "sinks")``) to compile in.
    ``additive_mask``: the call has a mask (a kernel that reads one; its tiles from
    :data:`MASKED_WIDE_TILES`).
    """
    dtype = normalize_dtype(dtype)
    archs = (arch,) if arch in ARCHS else ("sm_80", "sm_90")
    decode = decode_rows is not None
    split = decode if split_kv is None else bool(split_kv)
    causal = bool(causal)
    flags = {name: True for name in variants}
    if additive_mask:
        flags["additive_mask"] = True
    if tensor_cores and dtype in ("float16", "bfloat16"):
        warps = 4
        block_m, block_n = default_tiling(head_dim, archs, additive_mask)
        if decode_rows is not None:
            warps = next((w for w in (1, 2, 4) if 16 * w >= decode_rows), 4)
            block_m, block_n = 16 * warps, default_block_n(head_dim)
        return KernelSpec(
            loop_order="v2",
            dtype=dtype,
            head_dim=head_dim,
            block_m=block_m,
            block_n=block_n,
            num_warps=warps,
            causal=causal,
            mma="mma_sync",
            smem_layout=default_smem_layout(head_dim),
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
