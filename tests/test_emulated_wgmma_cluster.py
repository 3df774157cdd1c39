"""Emulation tier of the wgmma forward's 2-CTA clusters (``cluster_m: 2``, docs/hopper.md): the
two blocks of a cluster hold adjacent query tiles of one head; each block's producer copies half
of every K and V tile by TMA multicast into both, and a ring slot is refilled only once the
consumers of both blocks released it (each consumer warp arrives on the slot's barrier in every
block). Against float64 on shapes that are no multiples of the tiles, with an odd number of
query tiles (the grid rounds up to whole clusters: the extra block copies its half of the keys
for its partner and writes nothing), GQA, packed GQA, both layouts, every loop schedule, the TMA
epilogue, key lengths with NaN past them.

Mutations that must fail: a consumer that releases a slot only in its own block (the partner
refills it while this block's products may still read it), no cluster barrier before leaving
(an arrival on a block that has exited), both blocks copying the same half of each tile.
"""

from __future__ import annotations

import zlib

import numpy as np
import pytest
from attention_cases import Case, CaseData, assert_matches, example_variants, make_case
from test_emulated_kernels import run_emulated

from kernelgen.errors import EmulatorError, InputError
from kernelgen.kernels.render import render
from kernelgen.references.attention import naive_attention
from kernelgen.runtime.launch import Problem, launch_geometry
from kernelgen.runtime.tensor_maps import tensor_map_layouts
from kernelgen.specs.forward import spec_from_dict

pytestmark = pytest.mark.emulate

BASE = dict(loop_order="v2", mma="wgmma", cluster_m=2)


def cluster_spec(**fields):
    return spec_from_dict({**BASE, **fields})


CLUSTER_CASES = [
    # (spec fields, case): 64-key tiles (32-row halves), the d128 default tiling (64-row
    # halves), four column blocks (d256), one consumer warpgroup (packed); odd and even numbers
    # of query tiles, a single query tile (its partner holds no row)
    (dict(dtype="bfloat16", head_dim=64, block_m=128, block_n=64), Case(1, 2, 1, 300, 200)),
    (dict(dtype="bfloat16", head_dim=128, block_m=128, block_n=128), Case(2, 4, 2, 17, 333)),
    (dict(dtype="float16", head_dim=256, block_m=128, block_n=64), Case(1, 2, 1, 200, 100)),
    (
        dict(dtype="bfloat16", head_dim=128, block_m=128, block_n=128, stages=3, overlap=True),
        Case(1, 2, 2, 140, 400, key_growth=6.0),
    ),
    (
        dict(dtype="bfloat16", head_dim=64, block_m=128, block_n=64, pingpong=True),
        Case(1, 2, 2, 200, 333, mask="full", scale=0.3),
    ),
    (
        dict(dtype="bfloat16", head_dim=128, block_m=128, block_n=128, q_in_registers=True),
        Case(1, 2, 1, 129, 257, layout="bshd"),
    ),
    (
        dict(dtype="bfloat16", head_dim=128, block_m=128, block_n=128, epilogue="tma"),
        Case(1, 2, 1, 200, 150),
    ),
    (
        dict(dtype="bfloat16", head_dim=128, block_m=64, block_n=128, pack_gqa=True),
        Case(1, 8, 2, 40, 190),
    ),
    (
        dict(dtype="bfloat16", head_dim=64, block_m=128, block_n=64, pack_gqa=True, epilogue="tma"),
        Case(2, 4, 2, 33, 100, layout="bshd"),
    ),
]


@pytest.mark.parametrize(("fields", "case"), CLUSTER_CASES, ids=lambda x: str(x)[:70])
def test_cluster_matches_float64(fields, case):
    spec = cluster_spec(**fields)
    seed = zlib.crc32(f"{spec.uri} {case}".encode())
    data = make_case(case, spec.dtype, spec.head_dim, False, seed)
    out, lse = run_emulated(spec, case, data)
    assert_matches(out, lse, data, spec.dtype)


def test_cluster_with_variants():
    spec = cluster_spec(
        dtype="bfloat16", head_dim=64, block_m=128, block_n=64, softcap=True, sinks=True, alibi=True
    )
    case = Case(1, 2, 1, 150, 300)
    values = example_variants(spec.variants, case.batch, case.heads, 7)
    data = make_case(case, spec.dtype, spec.head_dim, False, 7, values)
    out, lse = run_emulated(spec, case, data, variants=values)
    assert_matches(out, lse, data, spec.dtype)


def test_cluster_with_key_lengths_and_nan_past_them():
    """seqlens_k per entry (0 keys: both blocks load nothing; 37 and 200: a partial last tile
    whose rows past the length each block zeroes in its own copy), NaN in every row past the
    lengths: out finite and equal to float64 attention of each entry's keys."""
    spec = cluster_spec(dtype="bfloat16", head_dim=128, block_m=128, block_n=128)
    case = Case(3, 2, 1, 150, 300)
    data = make_case(case, spec.dtype, spec.head_dim, False, seed=9)
    lengths = np.array([37, 0, 200], np.int32)
    k, v = data.k.copy(), data.v.copy()
    for b, n in enumerate(lengths):
        k[b, :, n:] = np.nan
        v[b, :, n:] = np.nan
    out, lse = run_emulated(
        spec, case, CaseData(data.q, k, v, None, data.ref_out, data.ref_lse), seqlens_k=lengths
    )
    assert np.isfinite(out).all() and not np.isnan(lse).any()
    assert (out[1] == 0).all() and np.isneginf(lse[1]).all()
    for b in (0, 2):
        n = lengths[b]
        q, kb, vb = data.q[b : b + 1], data.k[b : b + 1, :, :n], data.v[b : b + 1, :, :n]
        ref_out, ref_lse = naive_attention(q, kb, vb, causal=False)
        entry = CaseData(q, kb, vb, None, ref_out, ref_lse)
        assert_matches(out[b : b + 1], lse[b : b + 1], entry, spec.dtype)


# ---- geometry ------------------------------------------------------------------------------


def problem(spec, seqlen_q: int, heads: int = 3, batch: int = 2) -> Problem:
    return Problem(
        batch=batch,
        num_heads=heads,
        num_kv_heads=heads,
        seqlen_q=seqlen_q,
        seqlen_k=100,
        head_dim=spec.head_dim,
        q_strides=(heads * seqlen_q * spec.head_dim, seqlen_q * spec.head_dim, spec.head_dim),
        k_strides=(heads * 100 * spec.head_dim, 100 * spec.head_dim, spec.head_dim),
        v_strides=(heads * 100 * spec.head_dim, 100 * spec.head_dim, spec.head_dim),
        out_strides=(heads * seqlen_q * spec.head_dim, seqlen_q * spec.head_dim, spec.head_dim),
    )


@pytest.mark.parametrize(("seqlen_q", "row_tiles"), [(1, 2), (128, 2), (129, 2), (300, 4)])
def test_the_grid_rounds_each_heads_tiles_up_to_whole_clusters(seqlen_q, row_tiles):
    spec = cluster_spec(dtype="bfloat16", head_dim=64, block_m=128, block_n=64)
    grid, block = launch_geometry(spec, problem(spec, seqlen_q))
    assert grid == (row_tiles * 2 * 3, 1, 1) and block == (384, 1, 1)
    plain = spec_from_dict({**spec.model_dump(), "cluster_m": 1})
    assert launch_geometry(plain, problem(plain, seqlen_q))[0][0] == -(-seqlen_q // 128) * 6


def test_each_block_copies_half_of_every_key_tile():
    spec = cluster_spec(dtype="bfloat16", head_dim=128, block_m=128, block_n=128)
    layouts = tensor_map_layouts(spec, problem(spec, 200))
    assert layouts["q_map"].box == (64, 128, 1, 1)
    assert layouts["k_map"].box == layouts["v_map"].box == (64, 64, 1, 1)
    source = render(spec)
    assert "__cluster_dims__(2, 1, 1)" in source
    assert "tma_load_4d_multicast(k_ring" in source and "tma_load_4d_multicast(v_ring" in source
    plain = render(spec_from_dict({**spec.model_dump(), "cluster_m": 1}))
    assert "__cluster_dims__" not in plain and "tma_load_4d_multicast(k_ring" not in plain


@pytest.mark.parametrize(
    ("fields", "refused"),
    [
        (dict(causal=True), "causal=True"),
        (dict(window=True), "window=True"),
        (dict(cluster_m=4), "cluster_m=4 is not allowed; use 1 or 2"),
        (dict(mma="mma_sync", block_m=64, num_warps=4, archs=("sm_80",)), "mma='mma_sync'"),
        (dict(split_kv=True, block_m=64), "split_kv=True"),
        (dict(dtype="float8_e4m3"), "dtype='float8_e4m3'"),
    ],
)
def test_refused_cluster_specs_name_the_field(fields, refused):
    base = dict(BASE, dtype="bfloat16", head_dim=128, block_m=128, block_n=128)
    with pytest.raises(ValueError, match="cluster_m") as raised:
        spec_from_dict({**base, **fields})
    assert refused in str(raised.value)


def test_a_cluster_spec_is_named_and_dumped_with_its_size():
    spec = cluster_spec(dtype="bfloat16", head_dim=128, block_m=128, block_n=128)
    assert spec.uri == "fa_fwd_v2_wg_bf16_d128_m128_n128_w12_s2_c2"
    assert spec.model_dump()["cluster_m"] == 2
    plain = spec_from_dict({**spec.model_dump(), "cluster_m": 1})
    assert "cluster_m" not in plain.model_dump() and not plain.uri.endswith("_c2")
    with pytest.raises(ValueError, match="cluster_m"):
        spec_from_dict({**spec.model_dump(), "cluster_m": True})


# ---- mutations ---------------------------------------------------------------------------------

MUTATION_SPEC = cluster_spec(dtype="bfloat16", head_dim=64, block_m=128, block_n=64)
MUTATIONS = {
    # released in this block only, the slot's barrier expecting this block's warps only: the
    # partner refills the slot while this block's products may still read it
    "release in one block only": (
        [
            (
                "if (lane < CLUSTER_M) mbarrier_arrive_cluster(kv_empty + 8 * slot, lane);",
                "if (lane == 0) mbarrier_arrive(kv_empty + 8 * slot);",
            ),
            ("4 * CONSUMERS * CLUSTER_M", "4 * CONSUMERS"),
        ],
        (EmulatorError, AssertionError),
    ),
    # no cluster barrier before leaving: the partner's last arrivals reach a block that has
    # exited (caught in every run: the emulator lets one block of a cluster lag behind)
    "no cluster barrier before leaving": (
        [
            ("{ cluster_sync(); return; }", "return;"),
            ("  cluster_sync();  // the other blocks' consumers may still arrive", "  //"),
        ],
        (EmulatorError,),
    ),
    # a block barrier instead of the cluster's after the initialisation: the partner's copies
    # and arrivals reach barriers with no barrier.cluster after their initialisation
    "no cluster barrier after the initialisation": (
        [("on its ring.\n  cluster_sync();", "on its ring.\n  __syncthreads();")],
        (EmulatorError,),
    ),
    # both blocks copy the first half: the second half of every tile never lands
    "both blocks copy the same half": (
        [("const unsigned slice = rank * KV_SLICE_ROWS * ROW_BYTES;", "const unsigned slice = 0;")],
        (EmulatorError, AssertionError),
    ),
}


@pytest.mark.parametrize("name", MUTATIONS)
def test_mutated_cluster_kernel_fails(name, monkeypatch):
    """The original passes; the mutant fails under the first of six fixed schedules tried (each
    failed under all of 12 seeds: a block lagging behind the other exposes the races, and the
    emulator asks for a barrier.cluster between a block's mbarrier.init and another block's
    access, whatever the order it ran them in)."""
    edits, errors = MUTATIONS[name]
    source = render(MUTATION_SPEC)
    mutant = source
    for original, replacement in edits:
        assert original in mutant, original
        mutant = mutant.replace(original, replacement)
    case = Case(1, 2, 1, 256, 640)  # 10 key tiles through a 2-slot ring: every slot reused
    data = make_case(case, MUTATION_SPEC.dtype, MUTATION_SPEC.head_dim, False, seed=13)
    out, lse = run_emulated(MUTATION_SPEC, case, data, source=source)
    assert_matches(out, lse, data, MUTATION_SPEC.dtype)
    for seed in range(1, 7):
        monkeypatch.setenv("KG_EMULATOR_SCHEDULE_SEED", str(seed))
        try:
            out, lse = run_emulated(MUTATION_SPEC, case, data, source=mutant)
            assert_matches(out, lse, data, MUTATION_SPEC.dtype)
        except errors:
            return
    pytest.fail(f"the mutant {name!r} passed under six schedules")


def test_a_cluster_spec_refuses_a_mismatched_call():
    """Nothing call-specific is refused beyond what the plain spec refuses: a causal call on a
    non-causal cluster spec is the usual spec/call mismatch (InputError naming causal)."""
    import kernelgen

    spec = cluster_spec(dtype="float16", head_dim=64, block_m=128, block_n=64)
    q = np.zeros((1, 2, 8, 64), np.float16)
    with pytest.raises(InputError, match="causal"):
        kernelgen.attention(q, q, q, causal=True, spec=spec)
