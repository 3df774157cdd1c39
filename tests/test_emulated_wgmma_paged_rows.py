"""Emulation tier: the wgmma forward on paged KV caches whose page size is no multiple of
block_n (16, 32, 48, 80 keys). A key tile then spans several pages, so
the producer warpgroup copies it row by row with 16-byte cp.async (each row's page from the
block table, rows past the keys zero-filled), signals the copies with
cp.async.mbarrier.arrive.noinc, and its thread 0 relays each tile to the consumers after a
fence.proxy.async (docs/hopper.md, "Decode and serving"). (Pages that hold whole tiles take
the TMA path: tests/test_emulated_wgmma_decode.py and _nan_rows.py.)

Against float64 NumPy: block_n 64 and 128, one and two consumer warpgroups, causal, GQA packed
and not, split and not, head dims 64, 96 and 128, the overlapped and ping-pong loops, lengths
no multiple of anything, the emulator's pools (pages in reverse order, a NaN spare page, NaN
page tails) and, through attention_with_kvcache, shuffled pages with spare ones. Kernel
mutations the tests catch: the swizzle's chunk, a missing arrive-on, the logical page for a
row, no zero-fill, no fence in the relay, a relay that does not wait for the copies.
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
    kvcache_data,
    kvcache_reference,
    make_case,
    nan_past_lengths,
    paged_cache,
)
from conftest import ROOT
from test_emulated_kernels import run_emulated
from test_emulated_wgmma import assert_mutant_fails

import kernelgen
from kernelgen.errors import CPUBackendWarning, InputError
from kernelgen.references.attention import naive_attention
from kernelgen.specs.forward import load_spec, spec_from_dict

pytestmark = pytest.mark.emulate

PAGED = load_spec(ROOT / "specs" / "v2_wg_f16_d128_m64_n64_s2_gqa_split_paged_causal.yaml")


def wg(**fields) -> object:
    base = dict(loop_order="v2", mma="wgmma", dtype="float16", head_dim=128, block_m=64)
    return spec_from_dict({**base, "block_n": 128, "paged_kv": True, **fields})


N128 = wg()  # one consumer, 128-key tiles, unpacked, unsplit
N128_PACKED = wg(block_m=128, pack_gqa=True, split_kv=True, causal=True, dtype="bfloat16")
D64 = wg(head_dim=64, block_n=64, split_kv=True)
D96 = wg(head_dim=96, block_m=128, block_n=64, causal=True)
OVERLAP = wg(block_m=128, block_n=64, overlap=True, stages=3)  # slots released a step later
PINGPONG = wg(block_m=128, block_n=64, pingpong=True, causal=True, dtype="bfloat16")
# Two stages: thread 0 relays tile t - 1 before it waits for tile t's slot, which the overlapped
# loop releases only once it has tile t - 1's K (relayed after that wait it deadlocked from the
# third tile on: found by kernelgen.testing.fuzz)
OVERLAP_S2 = wg(head_dim=64, block_n=64, overlap=True)

# spec, case (B, H, Hkv, Sq, Sk), split count, page size, per-entry lengths (None: Sk)
CASES = [
    pytest.param(PAGED, Case(2, 8, 2, 5, 150), 3, 16, None, id="n64-page16-packed-split"),
    pytest.param(PAGED, Case(2, 8, 1, 3, 203), 2, 48, [203, 77], id="n64-page48-mqa-lengths"),
    pytest.param(N128, Case(2, 4, 2, 9, 211), None, 16, [211, 130], id="n128-page16"),
    pytest.param(N128, Case(1, 2, 1, 2, 170), None, 80, None, id="n128-page80"),
    pytest.param(N128_PACKED, Case(2, 8, 2, 20, 300), 3, 48, [300, 41], id="m128-page48"),
    pytest.param(D64, Case(2, 4, 4, 6, 140), 2, 32, [140, 1], id="d64-page32-split"),
    pytest.param(D96, Case(1, 6, 2, 70, 130), None, 16, None, id="d96-page16-causal"),
    pytest.param(OVERLAP, Case(1, 4, 2, 90, 275), None, 48, [275], id="overlap-s3-page48"),
    pytest.param(PINGPONG, Case(2, 2, 1, 130, 180), None, 16, [180, 99], id="pingpong-page16"),
    pytest.param(OVERLAP_S2, Case(1, 2, 1, 40, 200), None, 16, [199], id="overlap-s2-page16"),
]


@pytest.mark.parametrize("spec, case, splits, page_size, lengths", CASES)
def test_paged_rows_match_float64(spec, case, splits, page_size, lengths):
    """Every page and the last page's tail past each length hold NaN in the emulator's pool (and
    page 0, a spare): out and lse finite and equal to float64 attention of each entry's keys."""
    seed = zlib.crc32(f"{spec.uri} {case} {page_size}".encode())
    data = make_case(case, spec.dtype, spec.head_dim, spec.causal, seed)
    if lengths is None:
        out, lse = run_emulated(spec, case, data, num_splits=splits, page_size=page_size)
        assert np.isfinite(out).all()
        assert_matches(out, lse, data, spec.dtype)
        return
    lengths = np.asarray(lengths, np.int32)
    k, v = data.k.copy(), data.v.copy()
    for b, n in enumerate(lengths):
        k[b, :, n:] = np.nan
        v[b, :, n:] = np.nan
    poisoned = CaseData(data.q, k, v, None, data.ref_out, data.ref_lse)
    out, lse = run_emulated(
        spec, case, poisoned, num_splits=splits, seqlens_k=lengths, page_size=page_size
    )
    assert np.isfinite(out).all() and not np.isnan(lse).any()
    for b, n in enumerate(lengths):
        q, kb, vb = data.q[b : b + 1], data.k[b : b + 1, :, :n], data.v[b : b + 1, :, :n]
        ref_out, ref_lse = naive_attention(q, kb, vb, causal=spec.causal)
        assert_matches(out[b : b + 1], lse[b : b + 1], CaseData(q, kb, vb, None, ref_out, ref_lse),
                       spec.dtype)  # fmt: skip


@pytest.mark.parametrize("page_size", [16, 80])
def test_attention_with_kvcache_on_shuffled_small_pages(page_size):
    """The public decode step (CPU backend) with the paged wgmma spec: pages shuffled in the
    pool, spare pages no entry names (4096: a read of one shows), NaN in every row past each
    entry's keys after the append, 2 new tokens appended first."""
    lengths, new_len, heads, kv_heads = [37, 150, 1], 2, 8, 2
    pages = -(-(max(lengths) + new_len) // page_size) + 1
    q, k_cache, v_cache, k_new, v_new = kvcache_data(
        3, new_len, new_len, pages * page_size, heads, kv_heads, "float16", 7, head_dim=128
    )
    k_cache, v_cache = (nan_past_lengths(c, lengths, new_len) for c in (k_cache, v_cache))
    k_pool, table, k_logical = paged_cache(k_cache, page_size, 7)
    v_pool, _, v_logical = paged_cache(v_cache, page_size, 7)  # same seed: same table
    assert not np.array_equal(table.ravel(), np.sort(table.ravel()))  # shuffled
    f16 = [x.astype(np.float16) for x in (q, k_pool, v_pool, k_new, v_new)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CPUBackendWarning)
        out, lse = kernelgen.attention_with_kvcache(
            *f16[:3],
            np.array(lengths, np.int32),
            block_table=table,
            k_new=f16[3],
            v_new=f16[4],
            causal=True,
            return_lse=True,
            spec=PAGED,
            num_splits=2,
        )
    want = kvcache_reference(q, k_logical, v_logical, k_new, v_new, lengths, True)
    check_kvcache(out, lse, *want, "float16")


def test_page_sizes_the_row_copies_cannot_take_raise():
    """Pages are copied in 16-key steps: another size is an InputError naming page_size."""
    case = Case(1, 4, 2, 1, 100)
    data = make_case(case, PAGED.dtype, PAGED.head_dim, True, seed=1)
    with pytest.raises(InputError, match=r"page_size=40 is not allowed .*multiple of 16"):
        run_emulated(PAGED, case, data, num_splits=2, page_size=40)


# ---- mutations: each must make a run fail (a hazard, a deadlock or a wrong result) ---------
ROW_MUTATIONS = {
    "the swizzle's chunk left out": (
        "((chunk ^ swizzle_phase(first_row)) * 16)",
        "(chunk * 16)",
    ),
    "no arrive-on after the K copies": ("cp_async_arrive_noinc(k_copied + 8 * slot);", ""),
    "every row from the tile's first page": (
        "__shfl_sync(0xffffffffu, r.lane_page, r.page_index)",
        "__shfl_sync(0xffffffffu, r.lane_page, 0)",
    ),
    "rows past the keys copied, not zero-filled": ("filled ? 16 : 0", "16"),
    "no fence.proxy.async in the relay": (
        "fence_proxy_async();  // the copies' generic-proxy bytes",
        "// no fence",
    ),
    "a relay that does not wait for the copies": (
        "mbarrier_wait(k_copied + 8 * slot, phase);",
        "",
    ),
}


@pytest.mark.parametrize("name", ROW_MUTATIONS)
def test_mutated_row_copies_fail(name):
    # lengths no multiple of the pages: the zero-fill has rows to fill (the spare page 0 and
    # the page tails hold NaN)
    assert_mutant_fails(
        PAGED, ROW_MUTATIONS[name], Case(2, 8, 2, 3, 150), seed=9, num_splits=2, page_size=48
    )
