"""Emulation tier of the TMA-store epilogue (``epilogue: tma``) of the split-KV wgmma forward
(docs/hopper.md): each consumer warpgroup stages its 64 rows of the chunk's fp32 partial o / l
with 8-byte st.shared in the 128-byte swizzled layout (32 columns per column block: its rows of
the Q tile and of the extra blocks after it), then one thread stores them through ``out_map``,
which maps o_partial (split, B, H, Sq, D) as (head dim, query, head, split * batch + b), or
5-d (head dim, head in the group, query, K/V head, split * batch + b) with packed GQA.

Against float64 (through the shared combine kernel), and bit for bit against the direct split
epilogue: split counts that do not divide the key tiles and more chunks than tiles (empty
chunks write the identity), packed groups 2, 4 and 8 and unpacked GQA, causal and not, Sq no
multiple of the tile nor of its queries, head dims 64, 96 (three fp32 column blocks) and 128,
a paged cache.
Mutations that must fail: the chunk left out of the store's coordinate, the staging unswizzled,
an out_map whose query extent overshoots seqlen_q (rows land past a head's partials: in a
padding after the buffer, which must stay NaN), and the epilogue's fence, named barrier and
wait_group.read removed (hazards).
"""

from __future__ import annotations

import dataclasses
import zlib

import numpy as np
import pytest
from attention_cases import Case, assert_matches, make_case
from test_emulated_kernels import run_emulated
from test_emulated_wgmma_tma_store import EPILOGUE_MUTATIONS

from kernelgen.calls.emulated import emulate_attention
from kernelgen.errors import HazardError
from kernelgen.kernels.render import render
from kernelgen.runtime import emulated_launch as launches
from kernelgen.runtime.emulated_launch import run_launches, to_device_dtype
from kernelgen.runtime.launch import scratch_floats
from kernelgen.runtime.tensor_maps import tensor_map_layouts
from kernelgen.specs.forward import spec_from_dict

pytestmark = pytest.mark.emulate

BASE = dict(loop_order="v2", mma="wgmma", split_kv=True)


def split_spec(epilogue: str = "tma", **fields):
    return spec_from_dict({**BASE, "epilogue": epilogue, **fields})


SHIPPED = dict(dtype="bfloat16", head_dim=128, block_m=64, block_n=128, pack_gqa=True)
CASES = [
    # (spec fields, case (B, H, Hkv, Sq, Sk), split count)
    pytest.param(SHIPPED, Case(2, 8, 2, 3, 300), 2, id="shipped-group4-splits-not-dividing"),
    pytest.param(SHIPPED, Case(1, 8, 2, 1, 129), 5, id="shipped-group4-empty-chunks"),
    pytest.param(
        dict(dtype="float16", head_dim=64, block_m=64, block_n=64, pack_gqa=True, causal=True),
        Case(1, 16, 2, 21, 200),
        3,
        id="group8-causal-sq21",  # 8 queries a tile: the last tile holds 5
    ),
    pytest.param(
        dict(dtype="bfloat16", head_dim=96, block_m=128, block_n=64, pack_gqa=True),
        Case(2, 4, 2, 37, 150),
        3,
        id="group2-d96-m128-sq37",  # three fp32 column blocks
    ),
    pytest.param(
        dict(dtype="float16", head_dim=64, block_m=128, block_n=64, causal=True),
        Case(1, 4, 2, 9, 150),
        3,
        id="unpacked-causal",
    ),
    pytest.param(
        dict(dtype="bfloat16", head_dim=128, block_m=64, block_n=64, pack_gqa=True),
        Case(1, 8, 1, 16, 200),
        2,
        id="mqa8-two-row-tiles",
    ),
]


@pytest.mark.parametrize(("fields", "case", "splits"), CASES)
def test_split_tma_store_matches_float64_and_the_direct_epilogue(fields, case, splits):
    spec = split_spec(**fields)
    seed = zlib.crc32(f"{spec.uri} {case} {splits}".encode())
    data = make_case(case, spec.dtype, spec.head_dim, spec.causal, seed)
    kept: dict = {}
    out, lse = run_emulated(spec, case, data, num_splits=splits, keep=kept)
    assert_matches(out, lse, data, spec.dtype)
    direct_kept: dict = {}
    direct = run_emulated(
        split_spec("direct", **fields), case, data, num_splits=splits, keep=direct_kept
    )
    np.testing.assert_array_equal(out, direct[0])
    np.testing.assert_array_equal(lse, direct[1])
    np.testing.assert_array_equal(kept["o_partial"], direct_kept["o_partial"])  # NaN == NaN


def test_split_tma_store_on_a_paged_cache():
    """The shipped paged decode tiling (64-key tiles, pages of 128 keys, causal, group 4)."""
    fields = dict(dtype="float16", head_dim=128, block_m=64, block_n=64, pack_gqa=True,
                  paged_kv=True, causal=True)  # fmt: skip
    spec, case = split_spec(**fields), Case(2, 8, 2, 5, 300)
    data = make_case(case, spec.dtype, spec.head_dim, spec.causal, seed=31)
    out, lse = run_emulated(spec, case, data, num_splits=3, page_size=128)
    assert_matches(out, lse, data, spec.dtype)


def test_split_tma_store_shared_memory():
    """The fp32 rows need head_dim * 4 / 128 column blocks: at d128, two past the Q tile's."""
    spec, direct = split_spec(**SHIPPED), split_spec("direct", **SHIPPED)
    assert (spec.out_column_blocks, spec.q_region_blocks, spec.column_blocks) == (4, 4, 2)
    assert spec.smem_bytes - direct.smem_bytes == 2 * spec.block_m * 128


# ---- mutations -------------------------------------------------------------------------------

MUTANT_SPEC = split_spec(**SHIPPED)
MUTANT_CASE = Case(1, 8, 2, 3, 300)  # 12 packed rows of 64: rows past Sq in every tile


def run_mutant(source: str | None = None, splits: int = 3):
    data = make_case(MUTANT_CASE, MUTANT_SPEC.dtype, MUTANT_SPEC.head_dim, False, seed=29)
    out, lse = run_emulated(MUTANT_SPEC, MUTANT_CASE, data, num_splits=splits, source=source)
    return out, lse, data


def test_the_mutant_case_passes():
    out, lse, data = run_mutant(render(MUTANT_SPEC))
    assert_matches(out, lse, data, MUTANT_SPEC.dtype)


@pytest.mark.parametrize(
    ("original", "mutated"),
    [
        pytest.param(
            "const int store_outer = int(blockIdx.y) * batch + store_b;",
            "const int store_outer = store_b;",
            id="every-chunk-stored-as-chunk-0",
        ),
        pytest.param(
            "const int chunk = ((col % 32) / 4) ^ swizzle_phase(st_row);",
            "const int chunk = (col % 32) / 4;",
            id="staging-unswizzled",
        ),
    ],
)
def test_split_store_mutations_give_wrong_numbers(original, mutated):
    source = render(MUTANT_SPEC)
    assert source.count(original) == 1, original
    out, lse, data = run_mutant(source.replace(original, mutated))
    with pytest.raises(AssertionError):
        assert_matches(out, lse, data, MUTANT_SPEC.dtype)


PAD_FLOATS = 64 * 128  # one warpgroup's rows of fp32 partials past o_partial's end


def partials_with_padding(layouts=tensor_map_layouts) -> np.ndarray:
    """The mutant case's launches (3 chunks) over an o_partial with PAD_FLOATS NaN floats past
    its last row, with the tensor maps of ``layouts``: returns that padding."""
    spec, case = MUTANT_SPEC, MUTANT_CASE
    data = make_case(case, spec.dtype, spec.head_dim, False, seed=29)
    first = emulate_attention(spec, data.q, data.k, data.v, num_splits=3)
    inputs = {"q": data.q, "k": data.k, "v": data.v}
    arrays = {name: to_device_dtype(x, spec.dtype) for name, x in inputs.items()}
    arrays["out"] = np.zeros(data.q.shape, np.uint16)
    arrays["lse"] = np.zeros(data.q.shape[:3], np.float32)

    def padded(spec, problem):
        floats = scratch_floats(spec, problem)
        return {**floats, "o_partial": floats["o_partial"] + PAD_FLOATS}

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(launches, "scratch_floats", padded)
        patch.setattr(launches, "tensor_map_layouts", layouts)
        run_launches(spec, first.problem, arrays, 1.0 / np.sqrt(spec.head_dim))
    return arrays["o_partial"][-PAD_FLOATS:]


def test_rows_past_seqlen_q_are_clipped_by_out_map():
    """Sq 3 of a 16-query tile: the stores clip rows 12..63 of every tile, so nothing lands
    past the last head's partials (o_partial has no padding between heads: rows past Sq would
    overwrite the next head's). A map whose query extent is the tile's 16 queries writes there."""

    def overshooting(spec, problem):
        layouts = tensor_map_layouts(spec, problem)
        out = layouts["out_map"]
        dims = (*out.dims[:2], 64 // problem.group, *out.dims[3:])
        return {**layouts, "out_map": dataclasses.replace(out, dims=dims)}

    assert np.isnan(partials_with_padding()).all()
    assert not np.isnan(partials_with_padding(overshooting)).all()


@pytest.mark.parametrize("name", EPILOGUE_MUTATIONS)
def test_mutated_split_epilogue_is_a_hazard(name):
    original, mutated, message = EPILOGUE_MUTATIONS[name]
    source = render(MUTANT_SPEC)
    assert source.count(original) == 1, original
    with pytest.raises(HazardError, match=message):
        run_mutant(source.replace(original, mutated))
