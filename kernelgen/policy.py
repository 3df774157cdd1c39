"""Launch policy: the spec a call runs without tuning (:func:`default_spec`) and when a call is a
decode step (:func:`decode_rows`). Below both the tuner (its candidates and heuristic) and the
API, so each reads it without importing the other."""

from __future__ import annotations

from kernelgen.arch import ARCHS
from kernelgen.errors import InputError
from kernelgen.spec import KernelSpec, default_smem_layout

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


def default_spec(
    dtype: str,
    head_dim: int,
    causal: bool,
    arch: str | None = None,
    *,
    tensor_cores: bool = True,
    decode_rows: int | None = None,
    split_kv: bool | None = None,
) -> KernelSpec:
    """A sensible spec for a shape until the autotuner chooses.

    float16/bfloat16 (with ``tensor_cores``): the mma.sync v2 kernel, 4 warps x 16 rows, 64 keys
    per tile (32 above head_dim 128), two stages, swizzled where the head dim allows. With
    ``decode_rows`` (a decode step's packed rows, :func:`decode_rows`): the decode kernel
    instead, GQA heads packed into the rows of the tiles, split-KV, as few warps as hold the
    rows (4 beyond 64 rows). ``split_kv`` True/False forces split-KV on or off (None: decode
    shapes only). Otherwise the CUDA-core v2 kernel with the largest tiles that fit (decode
    shapes: 16-row tiles and split-KV as well).
    """
    archs = (arch,) if arch in ARCHS else ("sm_80", "sm_90")
    decode = decode_rows is not None
    split = decode if split_kv is None else split_kv
    if tensor_cores and dtype in ("float16", "bfloat16"):
        warps = 4
        if decode_rows is not None:
            warps = next((w for w in (1, 2, 4) if 16 * w >= decode_rows), 4)
        return KernelSpec(
            loop_order="v2",
            dtype=dtype,
            head_dim=head_dim,
            block_m=16 * warps,
            block_n=default_block_n(head_dim),
            num_warps=warps,
            causal=causal,
            mma="mma_sync",
            smem_layout=default_smem_layout(head_dim),
            pack_gqa=decode,
            split_kv=split,
            archs=archs,
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
                archs=archs,
            )
        except ValueError:
            continue
    raise InputError(f"no default kernel fits head_dim={head_dim}, dtype={dtype} on {archs}")
