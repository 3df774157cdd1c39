"""Emulation tier, issue 33: the rows of K and V past an entry's length that a wgmma kernel's
TMA copies anyway (in-bounds memory: a cache longer than the entry with ``seqlens_k``, the
unused rows of a last page) have no effect whatever they hold. Those rows hold NaN here (as
torch.empty / cupy.empty memory or a freed page may), and every output must be finite and
match float64 attention of each entry's own keys.

Covered: each loop of the bf16 d128 specs (plain, overlapped, Q in registers, ping-pong) with
contiguous seqlens_k; split-KV decode with packed GQA; a paged cache whose pages past the
lengths, and the last page's tail, hold NaN. Mutations that must fail: no zeroing (NaN in out),
no fence.proxy.async after the zeroing stores, no named barrier between the zeroing warps, and
zeroing before the tile's copy has landed (hazards the emulator reports); and in the emulator,
mbarrier arrivals that pass on no phases (the correct kernel then raises a false hazard).
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
from test_emulator_hopper import mutated  # noqa: F401 (a fixture)

import kernelgen
from kernelgen.errors import CPUBackendWarning, EmulatorError, HazardError
from kernelgen.kernels.render import render
from kernelgen.references.attention import naive_attention
from kernelgen.specs.forward import KernelSpec, load_spec, spec_from_dict

pytestmark = pytest.mark.emulate


def spec_named(name: str) -> KernelSpec:
    return load_spec(ROOT / "specs" / f"{name}.yaml")


LOOPS = [
    "v2_wg_bf16_d128_m128_n128_s2",  # the plain loop (the causal default at head dim 128)
    "v2_wg_bf16_d128_m128_n128_s3_ovl",  # the intra-warpgroup overlap
    "v2_wg_bf16_d128_m128_n128_s2_qr",  # Q in registers (the default without causality)
    "v2_wg_bf16_d128_m128_n64_s2_ovl",  # the overlap at 64-key tiles
    "v2_wg_bf16_d128_m128_n64_s2_pp_causal",  # ping-pong
]
SPLIT = spec_named("v2_wg_bf16_d128_m64_n128_s2_gqa_split")
PAGED = spec_named("v2_wg_f16_d128_m64_n64_s2_gqa_split_paged_causal")


def nan_past(data: CaseData, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """k and v with every row past each entry's length NaN."""
    k, v = data.k.copy(), data.v.copy()
    for b, n in enumerate(lengths):
        k[b, :, n:] = np.nan
        v[b, :, n:] = np.nan
    return k, v


def run_with_nan_rows(
    spec: KernelSpec, case: Case, lengths: list[int], seed: int, **options: object
) -> None:
    """The spec on ``case`` with seqlens_k = ``lengths`` and NaN past them: out and lse finite
    and each entry equal to float64 attention of its first lengths[b] keys."""
    data = make_case(case, spec.dtype, spec.head_dim, spec.causal, seed)
    lengths = np.asarray(lengths, dtype=np.int32)
    k, v = nan_past(data, lengths)
    poisoned = CaseData(data.q, k, v, None, data.ref_out, data.ref_lse)
    out, lse = run_emulated(spec, case, poisoned, seqlens_k=lengths, **options)
    assert np.isfinite(out).all() and not np.isnan(lse).any()
    for b, n in enumerate(lengths):
        q, kb, vb = data.q[b : b + 1], data.k[b : b + 1, :, :n], data.v[b : b + 1, :, :n]
        ref_out, ref_lse = naive_attention(q, kb, vb, causal=spec.causal)
        entry = CaseData(q, kb, vb, None, ref_out, ref_lse)
        assert_matches(out[b : b + 1], lse[b : b + 1], entry, spec.dtype)


@pytest.mark.parametrize("name", LOOPS)
def test_each_loop_ignores_nan_rows_past_seqlens_k(name):
    """Lengths whose last tile is partial (37: the only tile; 200), of two tiles exactly (no
    zeroing: the NaN rows start a tile the block never visits), per loop schedule."""
    spec = spec_named(name)
    lengths = [37, 2 * spec.block_n, 200]
    case = Case(3, 2, 1, 20, 300)
    run_with_nan_rows(spec, case, lengths, seed=zlib.crc32(name.encode()))


def test_split_kv_decode_ignores_nan_rows_past_seqlens_k():
    """Packed GQA 4, 3 chunks: only the chunk holding the entry's last tile zeroes."""
    run_with_nan_rows(SPLIT, Case(2, 8, 2, 3, 300), [131, 250], seed=3, num_splits=3)


@pytest.mark.parametrize("page_size", [64, 128])
def test_paged_cache_ignores_nan_rows_and_pages_past_seqlens_k(page_size):
    """The pages past each length and the last page's tail hold NaN (the emulator pads the
    pages past Sk with NaN too; its spare page 0 is NaN)."""
    run_with_nan_rows(
        PAGED, Case(3, 8, 2, 5, 300), [131, 1, 300], seed=page_size, num_splits=3,
        page_size=page_size,
    )  # fmt: skip


# the split decode spec in float16 (NumPy has no bfloat16 for the public API's host path)
SPLIT_F16 = spec_from_dict(
    dict(loop_order="v2", mma="wgmma", dtype="float16", head_dim=128, block_m=64, block_n=128)
    | dict(pack_gqa=True, split_kv=True)
)


@pytest.mark.parametrize("spec", [SPLIT_F16, PAGED], ids=["contiguous", "paged"])
def test_attention_with_kvcache_on_nan_filled_caches(spec):
    """The public decode step (CPU backend) on caches whose rows past each entry's keys after the
    append are NaN (paged: the pages past them too; spare pages 4096), 2 new tokens appended."""
    lengths, new_len, heads, kv_heads, max_keys = [37, 150, 1], 2, 8, 2, 256
    q, k_cache, v_cache, k_new, v_new = kvcache_data(
        3, new_len, new_len, max_keys, heads, kv_heads, spec.dtype, 33, spec.head_dim
    )
    k_cache, v_cache = (nan_past_lengths(c, lengths, new_len) for c in (k_cache, v_cache))
    k_arg, v_arg, table = k_cache, v_cache, None
    if spec.paged_kv:
        k_arg, table, _ = paged_cache(k_cache, 128, seed=33)
        v_arg, _, _ = paged_cache(v_cache, 128, seed=33)  # same seed: same table
    f16 = [x.astype(np.float16) for x in (q, k_arg, v_arg, k_new, v_new)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CPUBackendWarning)
        out, lse = kernelgen.attention_with_kvcache(
            *f16[:3],
            np.array(lengths, np.int32),
            block_table=table,
            k_new=f16[3],
            v_new=f16[4],
            causal=spec.causal,
            return_lse=True,
            spec=spec,
            num_splits=2,
        )
    want = kvcache_reference(q, k_cache, v_cache, k_new, v_new, lengths, spec.causal)
    check_kvcache(out, lse, *want, spec.dtype)


# ---- mutations: the zeroing and its synchronisation ------------------------------------------
MUTATIONS = {
    "no zeroing": ("          st_shared_zero16(first + cb * KV_BLOCK_BYTES + c * 16);\n", ""),
    "no fence.proxy.async after the stores": (
        "      fence_proxy_async();                   // the generic-proxy stores",
        "      // fence_proxy_async();",
    ),
    "no named barrier between the zeroing warps": (
        "      named_barrier_sync(ZERO_BARRIER, 96);",
        "      // named_barrier_sync(ZERO_BARRIER, 96);",
    ),
    "zeroing before the copy landed": (
        "      mbarrier_wait(v_staged, 0);\n",
        "",
    ),
}


@pytest.mark.parametrize("name", MUTATIONS)
def test_mutated_zeroing_fails(name):
    spec = spec_named(LOOPS[0])
    original, replacement = MUTATIONS[name]
    source = render(spec).replace(original, replacement)
    assert render(spec).count(original) == 1, original
    with pytest.raises((EmulatorError, AssertionError)) as failure:
        run_with_nan_rows(spec, Case(2, 2, 1, 20, 300), [37, 200], seed=5, source=source)
    if name != "no zeroing":  # a hazard, not a wrong number: the emulator's check found it
        assert failure.errisinstance(HazardError)


def test_mutation_mbarrier_passing_no_phases_on_is_caught(mutated):  # noqa: F811
    """An emulator whose mbarrier arrivals do not pass on the phases their threads saw
    complete: the consumers learn that the last V tile's copy landed (on v_staged) only through
    the producer's arrival on v_full, so the unmutated kernel raises a false hazard."""
    from kernelgen.runtime import emulated_launch as launches

    mutated(
        "kg_mbarrier.h",
        "for (const SeenPhase& s : b.seen_at[(completed - 1) % 4]) mbarrier_know(s.slot, "
        "s.completed);",
        "",
    )
    launches.spec_kernels.cache_clear()  # build with the mutated headers
    try:
        with pytest.raises(HazardError, match="before its TMA write completed"):
            run_with_nan_rows(spec_named(LOOPS[0]), Case(1, 2, 1, 20, 300), [200], seed=6)
    finally:
        launches.spec_kernels.cache_clear()
