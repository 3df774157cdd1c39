"""Emulation tier for the widest tensor-core tilings: 8 warps of 32 query rows (block_m 256, the
untuned default from head dim 104 to 128: kernelgen.model.policy.WIDE_TILES) and key tiles that are
no power of two (48, 80, 112), against float64 NumPy.

The cases put partial row and key tiles on both sides, two row tiles of 256, GQA and MQA, both
layouts of q/k/v and of shared memory, additive masks with empty rows, a row maximum that keeps
moving (the rescale path), causal masks with Sq < Sk and Sq > Sk, split-KV chunks that start
inside a key tile's range, and a paged cache whose pages do and do not hold whole 48-key tiles.
In the matrix cases ldmatrix must also read without bank conflicts (wavefronts equal the ideal).
"""

from __future__ import annotations

import zlib

import pytest
from attention_cases import Case, assert_matches, make_case
from test_emulated_kernels import run_emulated

from kernelgen.model.policy import default_spec
from kernelgen.specs.forward import KernelSpec

pytestmark = pytest.mark.emulate


def tc_spec(
    dtype: str, head_dim: int, block_n: int, layout: str, causal: bool, **more
) -> KernelSpec:
    fields = {"block_m": 256, "num_warps": 8, **more}  # 8 warps x 32 rows unless given
    return KernelSpec(
        loop_order="v2",
        mma="mma_sync",
        dtype=dtype,
        head_dim=head_dim,
        block_n=block_n,
        smem_layout=layout,
        causal=causal,
        **fields,
    )


MATRIX = [
    # the default at head dim 128 (bf16, f16; causal or not)
    (tc_spec("bfloat16", 128, 48, "padded", False), Case(1, 4, 2, 260, 100)),
    (
        tc_spec("float16", 128, 48, "padded", True),
        Case(1, 2, 1, 261, 200, layout="bshd", mask="broadcast"),
    ),
    (tc_spec("float16", 128, 48, "padded", False), Case(1, 2, 2, 40, 300, key_growth=6.0)),
    (tc_spec("bfloat16", 128, 48, "padded", True), Case(1, 2, 2, 300, 97, mask="full")),
    # head dims the same default serves: zero-filled padding columns at 120 and 104
    (tc_spec("bfloat16", 120, 48, "padded", True), Case(1, 1, 1, 270, 200, scale=0.3)),
    (tc_spec("float16", 104, 48, "padded", False), Case(1, 1, 1, 257, 100, scale=-0.2)),
    # the swizzled layout with 48-key tiles, and other key tiles that are no power of two
    (tc_spec("bfloat16", 128, 48, "swizzled", True), Case(1, 1, 1, 260, 200)),
    (tc_spec("float16", 64, 80, "swizzled", False), Case(1, 2, 1, 200, 333, layout="bshd")),
    (
        tc_spec("bfloat16", 96, 112, "padded", True, block_m=64, num_warps=4),
        Case(2, 2, 1, 90, 250, mask="broadcast"),
    ),
]


@pytest.mark.parametrize(("spec", "case"), MATRIX, ids=lambda x: getattr(x, "uri", str(x)))
def test_wide_and_odd_tiles_match_float64(spec, case):
    seed = zlib.crc32(f"{spec.uri} {case}".encode())
    data = make_case(case, spec.dtype, spec.head_dim, spec.causal, seed)
    stats: dict = {}
    out, lse = run_emulated(spec, case, data, stats=stats)
    assert_matches(out, lse, data, spec.dtype)
    ran = spec.with_additive_mask() if data.mask is not None else spec  # what attention() runs
    launched = stats[ran.uri]
    assert launched.ldmatrix_wavefronts == launched.ldmatrix_ideal, launched.first_conflict
    assert launched.ldmatrix > 0


@pytest.mark.parametrize(
    ("arch", "tiles"), [(None, (256, 48, 8, 32)), ("sm_90", (128, 48, 4, 32))], ids=str
)
def test_the_head_dim_128_default_matches_float64(arch, tiles):
    """What attention() runs untuned at head dim 128 with mma.sync, end to end: the portable
    default (8 warps, the model's choice) and sm_90's (4 warps, measured fastest on an H100)."""
    spec = default_spec("bfloat16", 128, True, arch)
    assert (spec.block_m, spec.block_n, spec.num_warps, spec.rows_per_warp) == tiles
    case = Case(1, 2, 1, 513, 420)  # MQA, three row tiles, the last with one row
    data = make_case(case, spec.dtype, spec.head_dim, spec.causal, seed=5)
    out, lse = run_emulated(spec, case, data)
    assert_matches(out, lse, data, spec.dtype)


@pytest.mark.parametrize("num_splits", [3, 7])
def test_split_kv_chunks_of_48_key_tiles(num_splits):
    """Chunks of whole 48-key tiles (the combine merges them); 7 chunks of 9 tiles leave some
    chunks empty for the causal rows of the first row tile."""
    spec = tc_spec("float16", 128, 48, "padded", True, split_kv=True)
    case = Case(1, 2, 1, 300, 400)
    data = make_case(case, spec.dtype, spec.head_dim, spec.causal, seed=num_splits)
    out, lse = run_emulated(spec, case, data, num_splits=num_splits)
    assert_matches(out, lse, data, spec.dtype)


@pytest.mark.parametrize("page_size", [16, 48, 64])
def test_paged_cache_under_48_key_tiles(page_size):
    """Pages of 48 keys hold whole tiles (one block-table load per tile); 16 and 64 do not (a
    lookup per page a thread's rows enter)."""
    spec = tc_spec("bfloat16", 128, 48, "padded", False, paged_kv=True)
    case = Case(2, 1, 1, 100, 230)
    data = make_case(case, spec.dtype, spec.head_dim, spec.causal, seed=page_size)
    out, lse = run_emulated(spec, case, data, page_size=page_size)
    assert_matches(out, lse, data, spec.dtype)
