"""Emulation tier of the Hopper (sm_90a) wgmma kernels: their generated CUDA (TMA, mbarriers,
wgmma, setmaxnreg) on the CPU emulator against float64 NumPy, every spec of specs/ on the
same cases as the other kernels (GQA, MQA, Sq != Sk, lengths that are not multiples of the tile,
masks with empty rows, both layouts, a moving row maximum, a negative scale). The emulator
raises on any hazard (an accumulator read before wgmma.wait_group, shared memory read before
its TMA copy completed its mbarrier phase), so a passing run is also hazard-free.

Mutations of the kernel source that the tests must catch: no wgmma.wait_group, no mbarrier
wait on the K tiles, the descriptors' swizzle mode off by one; in the overlapped loop either
of its two waits left out; in ping-pong (plain and overlapped) a hand-over that never comes
or goes to the wrong barrier, a consumer that does not wait for its turn, and in the
overlapped one consumer 0 waiting for its first turn or tile 0's turn counted as the last.
"""

from __future__ import annotations

import zlib

import numpy as np
import pytest
from attention_cases import Case, CaseData, assert_matches, make_case
from conftest import WGMMA_SPEC_PATHS
from test_emulated_kernels import CASES, run_emulated

from kernelgen.errors import CPUBackendWarning, EmulatorError, HazardError
from kernelgen.kernels.render import render
from kernelgen.references.attention import naive_attention
from kernelgen.specs.forward import load_spec, spec_from_dict

pytestmark = pytest.mark.emulate


# The untuned defaults (kernelgen.model.policy.hopper_default_spec at d128: Q in registers
# without causality, from shared memory with it) run every case.
# Every other spec file runs the two cases that cross several tiles (GQA with partial tiles; both
# ways with a full mask and a scale) and one of the other four in turn, so each of those still
# runs on a quarter of the loops, and a spec's own feature has its own test file: 3 emulated
# runs instead of 6, for CI's time.
FULL_MATRIX_SPECS = ("v2_wg_bf16_d128_m128_n128_s2_qr", "v2_wg_bf16_d128_m128_n128_s2_causal")
ROTATING_CASES = (CASES[1], CASES[2], CASES[4], CASES[5])


def _spec_matrix() -> list:
    """(path, case) of every 16-bit wgmma spec file: all cases for the defaults, three else.
    fp8 specs take e4m3 bit patterns and descales: tests/test_emulated_fp8.py runs them."""
    paths = sorted(p for p in WGMMA_SPEC_PATHS if not load_spec(p).fp8)
    params = []
    for index, path in enumerate(paths):
        rotating = ROTATING_CASES[index % len(ROTATING_CASES)]
        chosen = CASES if path.stem in FULL_MATRIX_SPECS else (CASES[0], CASES[3], rotating)
        params += [pytest.param(path, case, id=f"{path.stem}-{case}") for case in chosen]
    return params


def test_the_spec_matrix_runs_every_case_on_the_defaults_and_three_elsewhere():
    matrix = _spec_matrix()
    by_spec: dict[str, list] = {}
    for param in matrix:
        by_spec.setdefault(param.values[0].stem, []).append(param.values[1])
    assert set(FULL_MATRIX_SPECS) <= set(by_spec)
    assert all(by_spec[name] == CASES for name in FULL_MATRIX_SPECS)
    assert all(len(cases) == 3 for name, cases in by_spec.items() if name not in FULL_MATRIX_SPECS)
    assert {str(c) for cases in by_spec.values() for c in cases} == {str(c) for c in CASES}


@pytest.mark.parametrize(("path", "case"), _spec_matrix())
def test_wgmma_spec_matches_float64_reference(path, case):
    from attention_cases import example_expressions, example_variants

    spec = load_spec(path)
    seed = zlib.crc32(f"{spec.uri} {case}".encode())
    variants = example_variants(spec.variants, case.batch, case.heads, seed, window=(70, 5))
    expressions, hooks = example_expressions(spec, case, seed)
    data = make_case(case, spec.dtype, spec.head_dim, spec.causal, seed, {**variants, **hooks})
    out, lse = run_emulated(spec, case, data, variants={**variants, **expressions})
    assert_matches(out, lse, data, spec.dtype)


def test_wgmma_null_lse_and_per_sequence_key_lengths():
    """No lse asked for (a null pointer), and seqlens_k (a KV cache: the keys past each entry's
    length are copied by TMA but hidden), each entry against its own float64 reference, an
    entry of no key included."""
    spec = load_spec(WGMMA_SPEC_PATHS[0])
    case = Case(2, 2, 1, 20, 90)
    data = make_case(case, spec.dtype, spec.head_dim, spec.causal, seed=5)
    out, lse = run_emulated(spec, case, data, want_lse=False)
    assert lse is None
    assert_matches(out, None, data, spec.dtype)
    lengths = np.array([90, 37], dtype=np.int32)
    out, lse = run_emulated(spec, case, data, seqlens_k=lengths)
    for b, n in enumerate(lengths):
        q, k, v = data.q[b : b + 1], data.k[b : b + 1, :, :n], data.v[b : b + 1, :, :n]
        ref_out, ref_lse = naive_attention(q, k, v, causal=spec.causal)
        entry = CaseData(q, k, v, None, ref_out, ref_lse)
        assert_matches(out[b : b + 1], lse[b : b + 1], entry, spec.dtype)
    # an entry with no key: its block loads nothing and writes the identity (out 0, lse -inf)
    out, lse = run_emulated(spec, case, data, seqlens_k=np.array([0, 90], dtype=np.int32))
    assert (out[0] == 0).all() and np.isneginf(lse[0]).all()
    q, k, v = (x[1:] for x in (data.q, data.k, data.v))
    second = CaseData(q, k, v, None, data.ref_out[1:], data.ref_lse[1:])
    assert_matches(out[1:], lse[1:], second, spec.dtype)


# ---- mutations: each must make the run fail (a hazard, a deadlock or a wrong result) --------
MUTANT_SPEC = spec_from_dict(
    dict(loop_order="v2", mma="wgmma", dtype="bfloat16", head_dim=64, block_m=64, block_n=32)
)
MUTATIONS = {
    "no wgmma.wait_group": (
        'asm volatile("wgmma.wait_group.sync.aligned %0;\\n" ::"n"(PENDING) : "memory");',
        "",
    ),
    "no mbarrier wait for the K tile": (
        "mbarrier_wait(k_full + 8 * slot, phase);",
        "",
    ),
    "64-byte swizzle in the descriptors": (
        "DESC_SWIZZLE_128B = 1u << 30;",
        "DESC_SWIZZLE_128B = 2u << 30;",
    ),
}


def test_the_unmutated_kernel_passes():
    case = Case(1, 2, 1, 70, 100)
    data = make_case(case, MUTANT_SPEC.dtype, MUTANT_SPEC.head_dim, MUTANT_SPEC.causal, 9)
    out, lse = run_emulated(MUTANT_SPEC, case, data)
    assert_matches(out, lse, data, MUTANT_SPEC.dtype)


def assert_mutant_fails(
    spec, mutation: tuple[str, str], case: Case, seed: int, **options: object
) -> None:
    """The spec's source with ``original`` (present once) replaced by ``mutated`` must fail:
    a hazard, a deadlock or a wrong result (``options``: run_emulated's, e.g. num_splits)."""
    original, mutated = mutation
    source = render(spec)
    assert source.count(original) == 1, original
    data = make_case(case, spec.dtype, spec.head_dim, spec.causal, seed)
    with pytest.raises((EmulatorError, AssertionError)):
        source = source.replace(original, mutated)
        out, lse = run_emulated(spec, case, data, source=source, **options)
        assert_matches(out, lse, data, spec.dtype)


@pytest.mark.parametrize("name", MUTATIONS)
def test_mutated_kernel_fails(name):
    assert_mutant_fails(MUTANT_SPEC, MUTATIONS[name], Case(1, 2, 1, 70, 100), seed=9)


def test_attention_on_host_arrays_runs_a_wgmma_spec():
    """kernelgen.attention() on NumPy arrays (the CPU backend) with a wgmma spec: the same call
    plan as on a GPU (PreparedLaunch, its tensor maps cached per address), GQA, causal, both
    layouts; a second call on the same arrays reuses the maps."""
    import warnings

    import kernelgen

    spec = next(s for s in map(load_spec, WGMMA_SPEC_PATHS) if s.causal and s.dtype == "float16")
    case = Case(1, 4, 2, 50, 80)
    data = make_case(case, spec.dtype, spec.head_dim, True, seed=21)
    q, k, v = (x.astype(np.float16) for x in (data.q, data.k, data.v))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CPUBackendWarning)
        for _ in range(2):
            out, lse = kernelgen.attention(q, k, v, causal=True, return_lse=True, spec=spec)
            assert_matches(out.astype(np.float32), lse, data, spec.dtype)
        bshd = [np.ascontiguousarray(x.transpose(0, 2, 1, 3)) for x in (q, k, v)]
        out = kernelgen.attention(*bshd, causal=True, layout="bshd", spec=spec)
    assert_matches(out.transpose(0, 2, 1, 3).astype(np.float32), None, data, spec.dtype)


def test_overlapped_kernel_reading_scores_before_their_products_retired_fails():
    """The overlapped loop waits for the older of its two product groups (S of tile j + 1)
    before the softmax; without that wait it reads S while wgmma still writes it (a hazard).
    Without the wait for P V that opens each step, O and P are touched under the product."""
    spec = spec_from_dict(
        dict(loop_order="v2", mma="wgmma", dtype="bfloat16", head_dim=64, block_m=64)
        | dict(block_n=32, overlap=True)
    )
    original = "wgmma_wait<1>();  // S of tile j + 1; tile j's P V may still run"
    source = render(spec)
    assert source.count(original) == 1
    case = Case(1, 2, 1, 70, 100)
    data = make_case(case, spec.dtype, spec.head_dim, spec.causal, 9)
    out, lse = run_emulated(spec, case, data, source=source)
    assert_matches(out, lse, data, spec.dtype)
    with pytest.raises(HazardError, match="wgmma"):
        run_emulated(spec, case, data, source=source.replace(original, ""))
    # the wait for tile j - 1's P V at the head of step j: without it O is rescaled and P
    # rewritten while that product still reads and accumulates them
    p_v = "wgmma_wait<0>();  // tile j - 1's P V: O is complete up to it, p is free"
    assert source.count(p_v) == 1
    with pytest.raises(HazardError, match="wgmma"):
        run_emulated(spec, case, data, source=source.replace(p_v, ""))


@pytest.mark.parametrize(
    "case", [Case(1, 2, 1, 1, 1), Case(1, 2, 2, 130, 333), Case(2, 2, 1, 64, 256)], ids=str
)
def test_overlap_with_q_in_registers_matches_float64(case):
    """The overlapped loop with Q's A fragments in registers (three stages, so the ring wraps
    at another tile than the unrolled body): one key tile, a count that is not a multiple of
    the ring, and one that is, against float64 with the hazard checks on."""
    spec = spec_from_dict(
        dict(loop_order="v2", mma="wgmma", dtype="bfloat16", head_dim=64, block_m=128)
        | dict(block_n=64, stages=3, overlap=True, q_in_registers=True)
    )
    seed = zlib.crc32(f"ovl qr {case}".encode())
    data = make_case(case, spec.dtype, spec.head_dim, spec.causal, seed)
    out, lse = run_emulated(spec, case, data)
    assert_matches(out, lse, data, spec.dtype)


# ---- the variants and user expressions (docs/variants.md, docs/expressions.md) ----

WG_VARIANTS = [
    # (spec fields, case, window)
    (dict(window=True, causal=True), Case(1, 2, 1, 150, 300), (70, 0)),
    (dict(softcap=True, alibi=True, sinks=True), Case(2, 2, 1, 70, 100, mask="broadcast"), None),
    (dict(window=True, sinks=True, overlap=True), Case(1, 2, 2, 130, 260), (40, 9)),
    (dict(causal=True, score_mod="score - 0.05 * abs(q_idx - kv_idx) ** 2 / 64",
          mask_mod="kv_idx % 3 != 1 or q_idx < 40"), Case(1, 2, 1, 90, 90), None),
]  # fmt: skip


@pytest.mark.parametrize("fields, case, window", WG_VARIANTS, ids=lambda x: str(x)[:40])
def test_wgmma_variants_and_expressions_match_the_reference(fields, case, window):
    from attention_cases import example_expressions, example_variants

    base = dict(loop_order="v2", mma="wgmma", dtype="bfloat16", head_dim=64, block_m=128)
    spec = spec_from_dict({**base, "block_n": 64, **fields})
    seed = zlib.crc32(spec.uri.encode())
    variants = example_variants(spec.variants, case.batch, case.heads, seed, window=window)
    expressions, hooks = example_expressions(spec, case, seed)
    data = make_case(case, spec.dtype, spec.head_dim, spec.causal, seed, {**variants, **hooks})
    stats: dict = {}
    out, lse = run_emulated(spec, case, data, variants={**variants, **expressions}, stats=stats)
    assert_matches(out, lse, data, spec.dtype)
    if window is not None:  # the producer loads only the window's key tiles
        left, right = window
        right = 0 if spec.causal else right
        tiles = 0
        for row0 in range(0, case.seqlen_q, spec.block_m):
            last = min(row0 + spec.block_m, case.seqlen_q) - 1
            offset = case.seqlen_k - case.seqlen_q
            begin = max(0, row0 + offset - left) // spec.block_n
            end = -(-max(0, min(case.seqlen_k, last + offset + right + 1)) // spec.block_n)
            tiles += max(0, end - begin)
        box = spec.block_n * 64 * 2  # one K tile: 64 columns of bf16 per column block
        k_bytes = tiles * case.batch * case.heads * box * spec.column_blocks
        assert stats[spec.uri].tma_bytes == k_bytes * 2 + _q_bytes(spec, case)


def _q_bytes(spec, case) -> int:
    """TMA bytes of the Q tiles: one BLOCK_M x head-dim box per block (zero-filled rows count)."""
    blocks = -(-case.seqlen_q // spec.block_m) * case.batch * case.heads
    return blocks * spec.block_m * 64 * 2 * spec.column_blocks


# ---- ping-pong: the consumers' turns on named barriers ----------------------------------------

PINGPONG_SPEC = spec_from_dict(
    dict(
        loop_order="v2", mma="wgmma", dtype="float16", head_dim=64, block_m=128, block_n=64,
        pingpong=True, causal=True,
    )
)  # fmt: skip
# Ping-pong on the overlapped loop: each turn issues a step's Q K^T and P V together (tile 0's
# Q K^T and the last tile's P V are turns of their own).
PINGPONG_OVERLAP_SPEC = PINGPONG_SPEC.model_copy(update={"overlap": True, "stages": 3})
PINGPONG_SPECS = {"plain": PINGPONG_SPEC, "overlap": PINGPONG_OVERLAP_SPEC}
PINGPONG_MUTATIONS = {
    # consumer 1 never hands the turn back: consumer 0 waits forever on barrier 1
    "no hand-over from consumer 1": (
        "if (consumer == 0 || !last) named_barrier_arrive(",
        "if (consumer == 0) named_barrier_arrive(",
    ),
    # the hand-over goes to the consumer's own barrier: both wait for an arrival on the other's
    "hand-over to the wrong barrier": (
        "named_barrier_arrive(TURN_BARRIER + 1 - consumer, 2 * 128);",
        "named_barrier_arrive(TURN_BARRIER + consumer, 2 * 128);",
    ),
    # consumer 0 takes its turns without waiting: consumer 1's hand-overs alone then complete
    # barrier 1, a phase nobody waits for, which the emulator reports
    "consumer 0 does not wait for its turn": (
        "if (consumer == 1 || !first) named_barrier_sync(",
        "if (consumer == 1) named_barrier_sync(",
    ),
    # neither consumer waits: both barriers complete by arrivals alone
    "no consumer waits for its turn": (
        "if (consumer == 1 || !first) named_barrier_sync(TURN_BARRIER + consumer, 2 * 128);",
        "",
    ),
}
# The overlapped loop's own turns: tile 0's Q K^T is a turn of its own before the loop's.
# (Issuing the last tile's P V outside the turns is not among these: its barriers then hold
# one hand-over at exit, which is valid on a GPU, and the numbers are right.)
PINGPONG_OVERLAP_MUTATIONS = {
    # consumer 0 waits for its first turn too: both consumers wait, nobody hands over
    "consumer 0 waits for its first turn": ("await_turn(true);", "await_turn(false);"),
    # tile 0's Q K^T counted as the last turn: consumer 1 does not hand it back
    "tile 0's turn counted as the last": (
        "hand_over_turn(false);  // the last turn",
        "hand_over_turn(true);  // the last turn",
    ),
}


@pytest.mark.parametrize("loop", PINGPONG_SPECS)
@pytest.mark.parametrize(
    "case", [Case(1, 2, 1, 1, 1), Case(1, 2, 1, 200, 333), Case(2, 2, 2, 130, 64)], ids=str
)
def test_pingpong_matches_float64_with_any_tile_count(case, loop):
    """One key tile, an odd count and an even one (causal: the rows' blocks see different
    counts), each against float64, on the plain and the overlapped loop: the turns match
    exactly whatever the count."""
    spec = PINGPONG_SPECS[loop]
    seed = zlib.crc32(f"pingpong {case}".encode())
    data = make_case(case, spec.dtype, spec.head_dim, True, seed)
    out, lse = run_emulated(spec, case, data)
    assert_matches(out, lse, data, spec.dtype)


@pytest.mark.parametrize(
    ("loop", "name"),
    [*((loop, name) for loop in PINGPONG_SPECS for name in PINGPONG_MUTATIONS),
     *(("overlap", name) for name in PINGPONG_OVERLAP_MUTATIONS)],
)  # fmt: skip
def test_mutated_pingpong_fails(loop, name, monkeypatch):
    """Each mutant deadlocks or completes a turn barrier that nobody waits for: a short
    watchdog (a correct run of this case takes about a second)."""
    monkeypatch.setenv("KG_EMULATOR_TIMEOUT", "10")
    mutation = {**PINGPONG_MUTATIONS, **PINGPONG_OVERLAP_MUTATIONS}[name]
    assert_mutant_fails(PINGPONG_SPECS[loop], mutation, Case(1, 2, 1, 200, 333), seed=4)


def test_a_missing_turn_wait_is_reported_as_a_phase_nobody_waited_for():
    """The skipped wait computes the right numbers (the barriers order issue, not data), so it
    is caught by the barrier count: the other consumer's hand-overs fill barrier 1 alone."""
    original, mutated = PINGPONG_MUTATIONS["consumer 0 does not wait for its turn"]
    case = Case(1, 2, 1, 200, 333)
    data = make_case(case, PINGPONG_SPEC.dtype, PINGPONG_SPEC.head_dim, True, 4)
    source = render(PINGPONG_SPEC).replace(original, mutated)
    with pytest.raises(EmulatorError, match="completed barrier 1 with no thread waiting"):
        run_emulated(PINGPONG_SPEC, case, data, source=source)


@pytest.mark.parametrize(
    ("head_dim", "variants", "causal"),
    [
        (128, ("window", "softcap", "alibi", "sinks"), True),
        (128, ("window", "softcap", "alibi", "sinks"), False),
        (64, (), True),
        (192, (), True),
    ],
    ids=str,
)
def test_the_untuned_hopper_default_matches_float64(head_dim, variants, causal):
    """What an untuned prefill call runs on a 9.0 device (policy.hopper_default_spec), with
    every built-in variant at head dim 128 (its 128-key tiles; Q in registers without
    causality), against float64."""
    from attention_cases import example_variants

    from kernelgen.model.policy import hopper_default_spec

    spec = hopper_default_spec("bfloat16", head_dim, causal, variants)
    assert spec.q_in_registers == (head_dim == 128 and not causal)
    case = Case(1, 2, 1, 150, 300)
    values = example_variants(spec.variants, case.batch, case.heads, 3, window=(70, 5))
    data = make_case(case, spec.dtype, spec.head_dim, spec.causal, 3, values)
    out, lse = run_emulated(spec, case, data, variants=values)
    assert_matches(out, lse, data, spec.dtype)


# The last key a row of the tile's first query sees, one too far in key_tiles: a key tile that
# hides only its last key from that row counts as interior (raw dot products, no per-key test).
# With the causal mask alone, and with a window whose right edge is the diagonal (left 1000).
DIAGONAL_BOUNDS = {
    "causal": (
        {"causal": True},
        None,
        "CAUSAL ? max(0, first_query + offset + 1) / BLOCK_N",
        "CAUSAL ? max(0, first_query + offset + 2) / BLOCK_N",
    ),
    "window": (
        {"window": True},
        (1000, 0),
        "min(seqlen_k, first_query + offset + va.right + 1)) / BLOCK_N",
        "min(seqlen_k, first_query + offset + va.right + 2)) / BLOCK_N",
    ),
}


@pytest.mark.parametrize("bound", DIAGONAL_BOUNDS)
def test_a_tile_hiding_only_its_last_key_takes_the_exact_path(bound):
    """Sk = Sq - 2 puts the second query tile's first diagonal (row 128 sees keys 0..126) one
    key short of key tile 0's end: that tile hides one key from that row, so it must not count
    as interior. The mutation (the bound one key too far) only this alignment exposes: the
    fuzzer's seeded copy went uncaught in 160 random cases, and so did every other wgmma test
    (two mma.sync tests caught each)."""
    from attention_cases import example_variants

    fields, window, original, mutated = DIAGONAL_BOUNDS[bound]
    spec = spec_from_dict(
        {"loop_order": "v2", "mma": "wgmma", "dtype": "bfloat16", "head_dim": 128,
         "block_m": 128, "block_n": 128, "stages": 2, **fields}
    )  # fmt: skip
    case = Case(1, 1, 1, 258, 256)
    values = example_variants(spec.variants, 1, 1, 5, window=window or (0, 0))
    data = make_case(case, spec.dtype, spec.head_dim, spec.causal, 5, values)
    out, lse = run_emulated(spec, case, data, variants=values)
    assert_matches(out, lse, data, spec.dtype)
    source = render(spec)
    assert source.count(original) == 1
    out, lse = run_emulated(
        spec, case, data, variants=values, source=source.replace(original, mutated)
    )
    with pytest.raises(AssertionError):
        assert_matches(out, lse, data, spec.dtype)
