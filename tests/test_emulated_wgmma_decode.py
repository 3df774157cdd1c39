"""Emulation tier of the Hopper (sm_90a) wgmma kernel's decode and serving forms: split-KV
(fp32 partials merged by the shared combine kernel), packed GQA (a 5-d Q tensor map whose box
holds whole queries) and a paged KV cache (one TMA copy per key tile from the page the block
table names), on the CPU emulator against float64 NumPy with its hazard checks on.

Cases: split counts that do not divide the key tiles (and more chunks than tiles: empty
chunks), GQA 4 and MQA, 1 to 16 queries (two row tiles at 16 x MQA), per-entry lengths that are
no multiple of the tiles (an empty entry included), page sizes of one, two and four tiles,
shuffled pages through attention_with_kvcache, the variants whose values follow a
packed row's head. Mutations the tests must catch: a wrong page lookup, a missing partial write,
a chunk that ignores its start, a packed row written to its block's first head.
"""

from __future__ import annotations

import warnings
import zlib

import numpy as np
import pytest
from attention_cases import (
    Case,
    CaseData,
    assert_matches,
    check_kvcache,
    example_variants,
    kvcache_data,
    kvcache_reference,
    make_case,
    paged_cache,
)
from conftest import ROOT
from test_emulated_kernels import run_emulated
from test_emulated_wgmma import assert_mutant_fails

import kernelgen
from kernelgen.errors import CPUBackendWarning, InputError
from kernelgen.kernels.render import render
from kernelgen.references.attention import naive_attention
from kernelgen.specs.forward import load_spec, spec_from_dict

pytestmark = pytest.mark.emulate

SPLIT = load_spec(ROOT / "specs" / "v2_wg_bf16_d128_m64_n128_s2_gqa_split.yaml")
PAGED = load_spec(ROOT / "specs" / "v2_wg_f16_d128_m64_n64_s2_gqa_split_paged_causal.yaml")
WG64 = dict(loop_order="v2", mma="wgmma", head_dim=64, block_m=64, block_n=64)


def wg(**fields) -> object:
    return spec_from_dict({**WG64, "dtype": "float16", **fields})


# spec, case (B, H, Hkv, Sq, Sk), split count, page size (paged specs)
CASES = [
    pytest.param(SPLIT, Case(2, 8, 2, 3, 300), 3, None, id="gqa4-sq3-3tiles-3splits"),
    pytest.param(SPLIT, Case(2, 8, 2, 3, 300), 2, None, id="gqa4-splits-not-dividing"),
    pytest.param(SPLIT, Case(1, 8, 2, 1, 129), 5, None, id="gqa4-sq1-empty-chunks"),
    pytest.param(SPLIT, Case(1, 8, 1, 16, 200), 2, None, id="mqa-sq16-two-row-tiles"),
    pytest.param(PAGED, Case(2, 8, 2, 5, 300), 3, 64, id="paged64-causal-gqa4"),
    pytest.param(PAGED, Case(1, 4, 1, 7, 250), 2, 128, id="paged128-mqa4"),
    pytest.param(PAGED, Case(2, 8, 1, 2, 333), 7, 256, id="paged256-mqa8-7splits"),
    pytest.param(wg(split_kv=True), Case(1, 4, 2, 9, 150), 3, None, id="split-unpacked"),
    pytest.param(wg(paged_kv=True), Case(2, 4, 2, 3, 200), None, 128, id="paged-unsplit"),
    pytest.param(
        wg(pack_gqa=True, split_kv=True, q_in_registers=True, dtype="bfloat16"),
        Case(2, 8, 2, 4, 190),
        3,
        None,
        id="q-registers-packed-split",
    ),
    pytest.param(wg(pack_gqa=True), Case(1, 16, 2, 6, 100), None, None, id="packed-unsplit"),
    pytest.param(  # head dim 192 (three column blocks), pages copied row by row (cp.async)
        wg(head_dim=192, pack_gqa=True, split_kv=True, paged_kv=True, causal=True),
        Case(2, 8, 2, 5, 300),
        3,
        48,
        id="d192-paged48-packed-split-causal",
    ),
]


@pytest.mark.parametrize("spec, case, splits, page_size", CASES)
def test_decode_form_matches_float64_reference(spec, case, splits, page_size):
    seed = zlib.crc32(f"{spec.uri} {case} {splits} {page_size}".encode())
    data = make_case(case, spec.dtype, spec.head_dim, spec.causal, seed)
    out, lse = run_emulated(spec, case, data, num_splits=splits, page_size=page_size)
    assert_matches(out, lse, data, spec.dtype)


@pytest.mark.parametrize(
    "fields",
    [
        dict(pack_gqa=True, split_kv=True, window=True, softcap=True, alibi=True, sinks=True),
        dict(pack_gqa=True, alibi=True, sinks=True, causal=True),
    ],
    ids=["split-window-softcap-alibi-sinks", "unsplit-alibi-sinks-causal"],
)
def test_packed_rows_take_their_own_heads_variants(fields):
    """ALiBi slopes and sinks are per query head: a packed tile's rows belong to several heads
    (split-KV: the combine adds the sinks)."""
    spec = wg(**fields)
    case = Case(2, 8, 2, 3, 170)
    seed = zlib.crc32(spec.uri.encode())
    variants = example_variants(spec.variants, case.batch, case.heads, seed, window=(70, 5))
    data = make_case(case, spec.dtype, spec.head_dim, spec.causal, seed, variants)
    splits = 3 if spec.split_kv else None  # attention() refuses a split count without split-KV
    out, lse = run_emulated(spec, case, data, num_splits=splits, variants=variants)
    assert_matches(out, lse, data, spec.dtype)


def test_per_entry_lengths_with_an_empty_entry():
    """seqlens_k no multiple of the tiles (the keys past an entry's length are copied by TMA
    and hidden), an entry of no key (every chunk empty: the combine of identities gives out 0,
    lse -inf), on the paged spec (its tiles stop at the entry's last page)."""
    case = Case(3, 8, 2, 2, 300)
    data = make_case(case, PAGED.dtype, PAGED.head_dim, PAGED.causal, seed=11)
    lengths = np.array([131, 0, 300], dtype=np.int32)
    out, lse = run_emulated(PAGED, case, data, num_splits=3, seqlens_k=lengths, page_size=64)
    assert (out[1] == 0).all() and np.isneginf(lse[1]).all()
    for b in (0, 2):
        n = lengths[b]
        q, k, v = data.q[b : b + 1], data.k[b : b + 1, :, :n], data.v[b : b + 1, :, :n]
        ref_out, ref_lse = naive_attention(q, k, v, causal=PAGED.causal)
        entry = CaseData(q, k, v, None, ref_out, ref_lse)
        assert_matches(out[b : b + 1], lse[b : b + 1], entry, PAGED.dtype)


@pytest.mark.parametrize("page_size", [64, 128])
def test_attention_with_kvcache_on_shuffled_pages(page_size):
    """attention_with_kvcache (CPU backend) with the paged wgmma spec: pages shuffled in the
    pool, spare pages that no entry names (4096: a read of one shows), new tokens appended
    before attending."""
    lengths, new_len, heads, kv_heads = [40, 70, 1], 2, 8, 2
    pages = -(-(max(lengths) + new_len) // page_size) + 1
    data = kvcache_data(
        3, new_len, new_len, pages * page_size, heads, kv_heads, "float16", 5, head_dim=128
    )
    q, k_cache, v_cache, k_new, v_new = data
    k_pool, table, k_logical = paged_cache(k_cache, page_size, 5)
    v_pool, _, v_logical = paged_cache(v_cache, page_size, 5)  # same seed: same table
    assert not np.array_equal(table.ravel(), np.sort(table.ravel()))  # shuffled
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CPUBackendWarning)  # (once per process)
        out, lse = kernelgen.attention_with_kvcache(
            q.astype(np.float16),
            k_pool.astype(np.float16),
            v_pool.astype(np.float16),
            np.array(lengths, np.int32),
            block_table=table,
            k_new=k_new.astype(np.float16),
            v_new=v_new.astype(np.float16),
            causal=True,
            return_lse=True,
            spec=PAGED,
            num_splits=2,
        )
    ref = kvcache_reference(q, k_logical, v_logical, k_new, v_new, lengths, True)
    check_kvcache(out, lse, *ref, "float16")


def test_wgmma_decode_calls_that_do_not_fit_raise():
    """A GQA group that does not divide block_m, or a page size that is no multiple of 16, is
    an InputError naming the value and what is allowed (pages of any multiple of 16 run:
    tests/test_emulated_wgmma_paged_rows.py)."""
    case = Case(1, 6, 2, 1, 100)  # group 3: no divisor of 64
    data = make_case(case, SPLIT.dtype, SPLIT.head_dim, False, seed=1)
    with pytest.raises(InputError, match=r"= 3 is not allowed .*must divide block_m"):
        run_emulated(SPLIT, case, data, num_splits=2)
    case = Case(1, 4, 2, 1, 100)
    data = make_case(case, PAGED.dtype, PAGED.head_dim, True, seed=1)
    with pytest.raises(InputError, match=r"page_size=40 is not allowed .*multiple of 16"):
        run_emulated(PAGED, case, data, num_splits=2, page_size=40)
    # through attention_with_kvcache: refused before the new tokens are written
    q, k_cache, v_cache, k_new, v_new = kvcache_data(2, 1, 1, 96, 6, 2, "float16", 3, 128)
    k_cache, v_cache = k_cache.astype(np.float16), v_cache.astype(np.float16)
    before = k_cache.copy(), v_cache.copy()
    split = spec_from_dict({**SPLIT.model_dump(), "dtype": "float16"})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CPUBackendWarning)
        with pytest.raises(InputError, match=r"= 3 is not allowed .*must divide block_m"):
            kernelgen.attention_with_kvcache(
                q.astype(np.float16), k_cache, v_cache, [5, 40],
                k_new=k_new.astype(np.float16), v_new=v_new.astype(np.float16), spec=split,
            )  # fmt: skip
    assert np.array_equal(k_cache, before[0]) and np.array_equal(v_cache, before[1])


# ---- mutations: each must make a run fail (a hazard, a deadlock or a wrong result) ---------
DECODE_MUTATIONS = {
    "the logical page instead of the block table's": (
        PAGED,
        "const int kv_row = page_row, kv_batch = pages[page];",
        "const int kv_row = page_row, kv_batch = page;",
    ),
    "no partial lse written": (
        SPLIT,
        "if (lane % 4 == 0) lse_partial[index] = natural_lse(m[0][half], row_l);",
        "",
    ),
    "a chunk that starts at the row's first tile": (
        SPLIT,
        "  tile_begin = chunk.first_tile;\n",
        "",
    ),
    "partials of packed rows at the block's first head": (
        SPLIT,
        "partial_index(row_index(row), batch, num_heads, seqlen_q)",
        "partial_index(((long long)b * num_heads + h) * seqlen_q + row, batch, num_heads, "
        "seqlen_q)",
    ),
    "the packed Q box at the tile's row, not its query": (
        SPLIT,
        "cb * ROW_ELEMS, 0, row0 / group, kv_head, b,",
        "cb * ROW_ELEMS, 0, row0, kv_head, b,",
    ),
}


@pytest.mark.parametrize("name", DECODE_MUTATIONS)
def test_mutated_decode_kernel_fails(name):
    spec, original, mutated = DECODE_MUTATIONS[name]
    # MQA x 16 queries: two row tiles per K/V head (the second starts at query 8)
    case = Case(1, 8, 1, 16, 300) if spec is SPLIT else Case(2, 8, 2, 3, 300)
    page_size = 64 if spec.paged_kv else None
    source = render(spec)
    assert source.count(original) == 1, original
    assert_mutant_fails(spec, (original, mutated), case, seed=9, num_splits=3, page_size=page_size)
