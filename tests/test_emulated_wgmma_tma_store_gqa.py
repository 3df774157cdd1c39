"""Emulation tier of the TMA-store epilogue (``epilogue: tma``) with packed GQA (docs/hopper.md):
a packed tile's rows are (query, head in the group) pairs, and each consumer warpgroup stores its
64 rows through a 5-d ``out_map`` (head dim, head in the group, query, K/V head, batch) whose box
(64, min(group, 64), max(64 / group, 1)) holds them in exactly the packed order.

Against float64 with groups 2, 4, 8 and 128 (MQA at 128 heads: each warpgroup stores half of one
query's heads), Sq no multiple of the tile nor of its queries (a last tile of a partial query
group), causal and not, both layouts; the rows of a padded output buffer past seqlen_q must stay
NaN (the map's query extent clips them). Mutations that must fail: an out box of one head per
query, the store at the tile's row instead of its query, and the epilogue's fence, named barrier
and wait_group.read removed (hazards).
"""

from __future__ import annotations

import dataclasses
import zlib

import numpy as np
import pytest
from attention_cases import Case, CaseData, assert_matches, make_case
from test_emulated_kernels import run_emulated
from test_emulated_wgmma_tma_store import EPILOGUE_MUTATIONS, run_into_padded_out, tma_spec

from kernelgen.errors import HazardError
from kernelgen.kernels.render import render
from kernelgen.runtime.tensor_maps import tensor_map_layouts

pytestmark = pytest.mark.emulate

PACKED = dict(pack_gqa=True)
PACKED_CASES = [
    # (spec fields, case (B, H, Hkv, Sq, Sk)): rows = Sq * group
    pytest.param(
        dict(dtype="bfloat16", head_dim=128, block_m=128, block_n=128),
        Case(2, 4, 2, 37, 150),
        id="group2-d128-m128-sq37",  # 74 rows: consumer 1 stores 10 of its 64
    ),
    pytest.param(
        dict(dtype="float16", head_dim=64, block_m=64, block_n=64, causal=True),
        Case(1, 8, 2, 21, 90, layout="bshd"),
        id="group4-m64-causal-bshd-sq21",  # 16 queries a tile: the second tile holds 5
    ),
    pytest.param(
        dict(dtype="bfloat16", head_dim=64, block_m=128, block_n=64, causal=True),
        Case(2, 16, 2, 13, 100, scale=-0.3),
        id="group8-m128-causal-sq13",  # 104 rows: consumer 1 stores queries 8..12
    ),
    pytest.param(
        dict(dtype="float16", head_dim=96, block_m=128, block_n=64, stages=3, overlap=True),
        Case(1, 16, 2, 9, 200, key_growth=6.0),
        id="group8-d96-overlap",
    ),
    pytest.param(
        dict(dtype="bfloat16", head_dim=64, block_m=128, block_n=64, q_in_registers=True),
        Case(1, 128, 1, 3, 70),
        id="mqa128-m128-qr",  # a box of 64 heads of one query per warpgroup
    ),
]


@pytest.mark.parametrize(("fields", "case"), PACKED_CASES)
def test_packed_tma_store_matches_float64(fields, case):
    spec = tma_spec(**PACKED, **fields)
    seed = zlib.crc32(f"{spec.uri} {case}".encode())
    data = make_case(case, spec.dtype, spec.head_dim, spec.causal, seed)
    out, lse = run_emulated(spec, case, data)
    assert_matches(out, lse, data, spec.dtype)


def test_packed_tma_store_on_a_paged_cache():
    """The tuner's paged decode twins: packed rows, 128-key pages, causal, group 4."""
    spec = tma_spec(**PACKED, dtype="float16", head_dim=128, block_m=64, block_n=64,
                    paged_kv=True, causal=True)  # fmt: skip
    case = Case(2, 8, 2, 6, 200)
    data = make_case(case, spec.dtype, spec.head_dim, spec.causal, seed=23)
    out, lse = run_emulated(spec, case, data, page_size=128)
    assert_matches(out, lse, data, spec.dtype)


def test_packed_tma_store_with_key_lengths_and_a_null_lse():
    """seqlens_k with an entry of no key (its blocks load no Q and store out = 0 through the
    tile), then a null lse."""
    spec = tma_spec(**PACKED, dtype="bfloat16", head_dim=64, block_m=64, block_n=64)
    case = Case(2, 8, 2, 5, 90)
    data = make_case(case, spec.dtype, spec.head_dim, False, seed=9)
    out, lse = run_emulated(spec, case, data, seqlens_k=np.array([90, 0], np.int32))
    assert (out[1] == 0).all() and np.isneginf(lse[1]).all()
    entry0 = CaseData(*(x[:1] for x in (data.q, data.k, data.v)), None,
                      data.ref_out[:1], data.ref_lse[:1])  # fmt: skip
    assert_matches(out[:1], lse[:1], entry0, spec.dtype)
    out, lse = run_emulated(spec, case, data, want_lse=False, seqlens_k=np.array([90, 90]))
    assert lse is None
    assert_matches(out, None, data, spec.dtype)


# ---- rows past seqlen_q: a padded output buffer whose padding must stay NaN -------------------

PADDED = tma_spec(**PACKED, dtype="bfloat16", head_dim=64, block_m=128, block_n=64)


def one_head_per_query(spec, problem):
    """Mutation: out_map's box of one head of 64 queries (the unpacked box) instead of the
    group's heads of 64 / group queries."""
    layouts = tensor_map_layouts(spec, problem)
    out = layouts["out_map"]
    return {**layouts, "out_map": dataclasses.replace(out, box=(out.box[0], 1, 64, 1, 1))}


def check_packed_padding(layout: str, layouts=tensor_map_layouts) -> None:
    """Group 4, Sq 21 (84 rows of a 128-row tile: consumer 1 holds queries 16..20 and 11
    queries past them, clipped by out_map): the padding stays NaN and out matches float64."""
    case = Case(2, 8, 2, 21, 100, layout=layout)
    data = make_case(case, PADDED.dtype, PADDED.head_dim, False, seed=13)
    out, padding = run_into_padded_out(PADDED, case, data, layouts)
    assert np.isnan(padding).all()
    assert_matches(out, None, data, PADDED.dtype)


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_packed_rows_past_seqlen_q_are_not_written(layout):
    check_packed_padding(layout)


def test_an_out_box_of_one_head_per_query_fails():
    with pytest.raises(AssertionError):
        check_packed_padding("bhsd", one_head_per_query)


def test_a_packed_store_at_the_tiles_row_fails():
    """Mutation: the store's query coordinate is the tile's row, not row / group (the stores
    land on later queries or are clipped: out keeps NaN or wrong rows)."""
    original = "store_row % group, store_row / group,"
    source = render(PADDED)
    assert source.count(original) == 1
    case = Case(1, 8, 2, 21, 100)
    data = make_case(case, PADDED.dtype, PADDED.head_dim, False, seed=17)
    out, lse = run_emulated(PADDED, case, data, source=source.replace(original, "0, store_row,"))
    with pytest.raises(AssertionError):
        assert_matches(out, lse, data, PADDED.dtype)


@pytest.mark.parametrize("name", EPILOGUE_MUTATIONS)
def test_mutated_packed_epilogue_is_a_hazard(name):
    original, mutated, message = EPILOGUE_MUTATIONS[name]
    source = render(PADDED)
    assert source.count(original) == 1, original
    case = Case(1, 4, 1, 40, 100)  # 160 rows: two tiles, the second one partly past the queries
    data = make_case(case, PADDED.dtype, PADDED.head_dim, False, seed=3)
    out, lse = run_emulated(PADDED, case, data, source=source)  # the original passes
    assert_matches(out, lse, data, PADDED.dtype)
    with pytest.raises(HazardError, match=message):
        run_emulated(PADDED, case, data, source=source.replace(original, mutated))
