"""CPU tier: candidates, pruning, keys, bucketing, the winner's choice and the controls."""

from __future__ import annotations

import dataclasses
import logging

import pytest
from test_tuning_fakes import (
    DEVICE,
    FAST,
    SOFTWARE,
    FakeBench,
    fake_compile,
    fake_tuner,
    problem,
    stable_ms,
)

from kernelgen.errors import KernelgenError
from kernelgen.model.policy import hopper_decode_spec, hopper_default_spec
from kernelgen.tuning import (
    DeviceInfo,
    ProblemDesc,
    TuningDB,
    TuningMissError,
    clear_memo,
    heuristic_spec,
    make_key,
    prune,
    select_spec,
    tune_problem,
    warmup,
)
from kernelgen.tuning.candidates import valid_candidates
from kernelgen.tuning.gpu import MAX_REPS, repetitions
from kernelgen.tuning.key import pow2_bucket
from kernelgen.tuning.measure import MeasureSettings, measure


@pytest.fixture(autouse=True)
def isolated(tuning_sandbox):
    """Every test gets its own tuning cache and memo (conftest)."""


# ---- candidates and pruning ---------------------------------------------------------------
def test_candidate_space_is_tens_not_thousands():
    for dtype in ("bfloat16", "float16", "float32"):
        specs, _ = valid_candidates(problem(dtype=dtype), "sm_90")
        # tens (16-bit on 9.0: the valid mma.sync sets, three fallbacks and the Hopper grid's
        # 33 at d128): the static model then compiles the best 16 and times the best 8 of those
        assert 5 <= len(specs) <= 90, (dtype, len(specs))
        assert len({s.uri for s in specs}) == len(specs)
    bf16, _ = valid_candidates(problem(), "sm_90")
    assert any(s.mma == "mma_sync" for s in bf16) and any(s.mma == "simt" for s in bf16)
    fp32, _ = valid_candidates(problem(dtype="float32"), "sm_90")
    assert all(s.mma == "simt" for s in fp32)


def test_two_m_tiles_per_warp_are_candidates_where_the_accumulators_fit():
    """The 32-row tilings (4 warps: block_m 128; 8 warps: 256): every block_n at head dim 64 but
    128 (192 accumulators, 176 at most), block_n 32 and 48 at 128, none at 256; the rest fail
    validation, with why."""
    for head_dim, block_ns in ((64, {32, 48, 64}), (128, {32, 48}), (256, set())):
        specs, dropped = valid_candidates(problem(head_dim=head_dim), "sm_90")
        for block_m in (128, 256):
            wide = {
                s.block_n
                for s in specs
                if s.mma == "mma_sync" and s.rows_per_warp == 32 and s.block_m == block_m
            }
            assert wide == block_ns, (head_dim, block_m)
        refused = [d for d in dropped if "block_m=128" in d.uri and "num_warps=4" in d.uri]
        assert refused and all("accumulators per thread" in d.reason for d in refused)


def test_pruning_reasons(caplog):
    spilling = "fa_fwd_v2_tc_bf16_d256_m64_n32_w4_s2_swz"
    broken = "fa_fwd_v2_tc_bf16_d256_m64_n32_w4_s2_pad"
    p = problem(head_dim=256)
    device = DeviceInfo("small smem", "8.6", 84)  # 99 KiB of shared memory per block
    with caplog.at_level(logging.INFO, logger="kernelgen.tuning"):
        kept, dropped = prune(p, device, fake_compile(frozenset({spilling}), frozenset({broken})))
    why = {d.uri: (d.stage, d.reason) for d in dropped}
    assert why[spilling][0] == "resources" and "spill" in why[spilling][1]
    assert why[broken][0] == "resources" and "compile failed" in why[broken][1]
    smem = [d for d in dropped if "exceeds" in d.reason]
    assert smem and all(d.stage == "validation" and "sm_86" in d.reason for d in smem)
    assert all(c.spec.smem_bytes <= 99 * 1024 for c in kept)
    assert {spilling, broken}.isdisjoint(c.spec.uri for c in kept)
    assert sum("dropped" in r.message for r in caplog.records) == len(dropped)


def test_invalid_combinations_are_dropped_with_the_spec_message():
    _, dropped = valid_candidates(problem(head_dim=80), "sm_90")
    swizzled = [d for d in dropped if "smem_layout=swizzled" in d.uri]
    assert swizzled and all("multiple of 64" in d.reason for d in swizzled)


def test_occupancy_drops_tilings_that_leave_sms_idle():
    p = problem(batch=1, num_heads=1, num_kv_heads=1, seqlen_q=128, seqlen_k=4096)
    kept, dropped = prune(p, DEVICE, fake_compile())
    occupancy = [d for d in dropped if d.stage == "occupancy"]
    assert occupancy and all("blocks" in d.reason for d in occupancy)
    assert min(c.spec.block_m for c in kept) == 32  # the tiling with the most blocks survives
    assert all(c.spec.block_m == 32 for c in kept if c.spec.loop_order == "v2")


# ---- keys and buckets ----------------------------------------------------------------------
def test_power_of_two_buckets():
    assert [pow2_bucket(n) for n in (1, 2, 3, 1000, 1024, 1025)] == [1, 2, 4, 1024, 1024, 2048]
    a = problem(seqlen_q=1000, seqlen_k=600, batch=3, num_heads=5, num_kv_heads=5)
    b = problem(seqlen_q=1024, seqlen_k=1024, batch=1, num_heads=16, num_kv_heads=16)
    assert a.bucket() == b.bucket()
    assert problem(seqlen_q=1025).bucket() != b.bucket()
    assert problem(num_kv_heads=4).bucket().gqa_ratio == 4
    assert problem(num_kv_heads=4).bucket() != b.bucket()
    assert problem(causal=True).bucket() != b.bucket()
    assert problem(mask=True).bucket() != b.bucket()


def test_shape_strings_and_dtype_aliases():
    p = ProblemDesc.from_shape("2,16,4,1000,2000,128", "bf16", causal=True)
    assert (p.dtype, p.gqa_ratio, p.batch_heads, p.causal) == ("bfloat16", 4, 32, True)
    for bad in ("1,2,3", "a,b,c,d,e,f", "1,16,5,8,8,64"):
        with pytest.raises(KernelgenError):
            ProblemDesc.from_shape(bad, "fp16")
    with pytest.raises(KernelgenError):
        ProblemDesc.from_shape("1,1,1,8,8,64", "int8")


@pytest.mark.parametrize(
    "change",
    [
        ("device", {"name": "Other GPU"}),
        ("device", {"sm_count": 114}),
        ("device", {"compute_capability": "8.0"}),
        ("software", {"template_hash": "cd" * 32}),
        ("software", {"kernelgen": "0.2.0"}),
        ("software", {"nvrtc": "13.1"}),
        ("software", {"cupy": "14.1.0"}),
    ],
)
def test_another_device_or_software_never_hits(change):
    part, fields = change
    key = make_key(problem(), DEVICE, SOFTWARE)
    db = TuningDB()
    db.save(fake_tuner()(problem(), key))
    assert db.load(key) is not None
    device = dataclasses.replace(DEVICE, **fields) if part == "device" else DEVICE
    software = dataclasses.replace(SOFTWARE, **fields) if part == "software" else SOFTWARE
    other = make_key(problem(), device, software)
    assert other.id != key.id
    assert db.load(other) is None
    db.path(other).write_bytes(db.path(key).read_bytes())  # even under the other key's name
    assert db.load(other) is None


def test_l2_size_is_not_part_of_the_key():
    bigger = dataclasses.replace(DEVICE, l2_bytes=50 << 20)
    assert make_key(problem(), bigger, SOFTWARE) == make_key(problem(), DEVICE, SOFTWARE)


# ---- measurement and the choice ------------------------------------------------------------
def specs_for(p):
    return [c.spec for c in prune(p, DEVICE, fake_compile())[0]]


def test_same_timings_give_the_same_winner():
    specs = specs_for(problem())
    first, _ = measure(specs, FakeBench(), FAST)
    second, _ = measure(list(reversed(specs)), FakeBench(), FAST)
    assert first is not None and second is not None
    assert first.spec == second.spec


def test_ties_are_broken_by_uri_whatever_the_order():
    specs = specs_for(problem())
    winners = {
        measure(order, FakeBench(timing=lambda s, n: 1.0), FAST)[0].spec.uri
        for order in (specs, list(reversed(specs)), specs[3:] + specs[:3])
    }
    assert winners == {min(s.uri for s in specs)}


def test_failures_score_infinity_and_the_best_few_are_retimed():
    specs = specs_for(problem())
    fastest = min(specs, key=lambda s: (FakeBench().timing(s), s.uri))
    bench = FakeBench(fail=frozenset({fastest.uri}))
    winner, results = measure(specs, bench, FAST)
    failed = next(m for m in results if m.spec == fastest)
    assert failed.status == "failed" and failed.median_ms == float("inf")
    assert winner is not None and winner.spec != fastest
    screened = len(specs) - 1  # the failure drops out in the screen
    assert len(bench.timed) == screened + FAST.kept_after_screen(screened) + FAST.retime_top
    assert sum(m.retime_ms is not None for m in results) == FAST.retime_top
    assert failed.as_dict()["median_ms"] is None  # JSON has no infinity


class BudgetBench(FakeBench):
    """Times that depend on the round: the short screen reads 2x faster than the full pass."""

    def time(self, spec, budget_ms, num_splits=None, *, min_reps):
        samples = super().time(spec, budget_ms, num_splits, min_reps=min_reps)
        return [x / 2 for x in samples] if budget_ms < FAST.budget_ms else samples


def test_a_screen_sends_only_the_best_on_to_the_full_pass():
    specs = specs_for(problem())
    assert len(specs) > FAST.screen_keep
    bench = BudgetBench()
    winner, results = measure(specs, bench, FAST)
    kept = FAST.kept_after_screen(len(specs))
    by_screen = sorted(results, key=lambda m: (m.screen_ms, m.launch.label))
    assert [m.status for m in by_screen[kept:]] == ["screened"] * (len(specs) - kept)
    assert "place" in by_screen[-1].reason and f"the best {kept} went on" in by_screen[-1].reason
    went_on = by_screen[:kept]
    assert all(m.median_ms == 2 * m.screen_ms for m in went_on)  # timed again in the full pass
    # screened-out candidates rank after every full-pass time, though their screens read lower
    assert winner is not None and winner in went_on[: FAST.retime_top]
    assert winner.spec == min(specs, key=lambda s: (stable_ms(s), s.uri))
    assert len(bench.timed) == len(specs) + kept + FAST.retime_top
    # the screen asks for fewer repetitions than the later rounds, so long launches save time
    rounds = [len(specs), kept, FAST.retime_top]
    assert bench.min_reps == [FAST.screen_min_reps] * rounds[0] + [FAST.min_reps] * sum(rounds[1:])
    assert FAST.screen_min_reps < FAST.min_reps
    assert sorted(bench.compiled) == sorted(s.uri for s in specs)  # one compile each
    assert all(m.as_dict()["screen_ms"] is not None for m in results)


def test_repetitions_fill_the_budget_between_the_floor_and_the_cap():
    settings = MeasureSettings()
    # a 10 ms launch: the screen's floor (5 x 10 ms), not 20 x 10 ms = 4x its 50 ms budget
    assert repetitions(settings.screen_budget_ms, 10.0, settings.screen_min_reps) == 5
    assert repetitions(settings.budget_ms, 10.0, settings.min_reps) == 20
    assert repetitions(settings.budget_ms, 0.5, settings.min_reps) == 400
    assert repetitions(settings.budget_ms, 1e-6, settings.min_reps) == MAX_REPS


def test_a_few_candidates_skip_the_screen():
    specs = specs_for(problem())[: FAST.screen_keep]
    bench = FakeBench()
    winner, results = measure(specs, bench, FAST)
    assert winner is not None and all(m.screen_ms is None for m in results)
    assert len(bench.timed) == len(specs) + FAST.retime_top
    assert "screened" not in {m.status for m in results}


def test_a_wrong_output_rejects_the_winner_for_the_next_best():
    specs = specs_for(problem())
    ranked = sorted(specs, key=lambda s: (FakeBench().timing(s), s.uri))
    bench = FakeBench(wrong=frozenset({ranked[0].uri}))
    winner, results = measure(specs, bench, FAST)
    assert winner is not None and winner.spec == ranked[1]
    assert bench.checked == [ranked[0].uri, ranked[1].uri]
    assert next(m for m in results if m.spec == ranked[0]).status == "rejected"


def test_tune_problem_records_every_candidate_and_drop():
    p = problem(head_dim=80)
    key = make_key(p, DEVICE, SOFTWARE)
    record = tune_problem(p, key, FakeBench(), compile_fn=fake_compile(), settings=FAST)
    assert len(record.candidates) == len(specs_for(p))
    assert sum(c["status"] == "winner" for c in record.candidates) == 1
    assert record.dropped and all({"uri", "stage", "reason"} <= set(d) for d in record.dropped)
    assert record.tuned_shape["head_dim"] == 80


# ---- select_spec and the controls ---------------------------------------------------------
def counting_tuner():
    calls = []
    inner = fake_tuner()

    def tuner(p, key):
        calls.append(key.id)
        return inner(p, key)

    return tuner, calls


def test_select_spec_tunes_once_then_reads_the_database():
    tuner, calls = counting_tuner()
    spec = select_spec(problem(), DEVICE, software=SOFTWARE, tuner=tuner)
    assert select_spec(problem(seqlen_q=900), DEVICE, software=SOFTWARE, tuner=tuner) == spec
    clear_memo()  # a new process: the disk answers
    assert select_spec(problem(), DEVICE, software=SOFTWARE, tuner=tuner) == spec
    assert len(calls) == 1
    assert spec.archs == (spec.compile_arch(DEVICE.arch),)  # sm_90a for wgmma, else sm_90


def test_autotune_off_uses_the_heuristic_default(monkeypatch, tmp_path):
    monkeypatch.setenv("KERNELGEN_AUTOTUNE", "0")
    tuner, calls = counting_tuner()
    spec = select_spec(problem(causal=True), DEVICE, software=SOFTWARE, tuner=tuner)
    assert spec == hopper_default_spec("bfloat16", 128, True)  # DEVICE is a 9.0 GPU
    assert spec == heuristic_spec(problem(causal=True), DEVICE)
    assert calls == [] and not (tmp_path / "cache").exists()


def test_offline_mode_raises_on_a_miss_and_reads_hits(monkeypatch):
    monkeypatch.setenv("KERNELGEN_AUTOTUNE", "offline")
    tuner, calls = counting_tuner()
    with pytest.raises(TuningMissError) as info:
        select_spec(problem(), DEVICE, software=SOFTWARE, tuner=tuner)
    assert isinstance(info.value, KernelgenError) and "kernelgen tune" in str(info.value)
    spec = select_spec(problem(), DEVICE, software=SOFTWARE, tuner=tuner, mode="on")
    clear_memo()
    assert select_spec(problem(), DEVICE, software=SOFTWARE, tuner=tuner) == spec
    assert len(calls) == 1


def test_bad_autotune_value_is_a_typed_error(monkeypatch):
    monkeypatch.setenv("KERNELGEN_AUTOTUNE", "maybe")
    with pytest.raises(KernelgenError, match="KERNELGEN_AUTOTUNE"):
        select_spec(problem(), DEVICE, software=SOFTWARE, tuner=fake_tuner())


def test_print_autotuning(monkeypatch, capsys):
    monkeypatch.setenv("KERNELGEN_PRINT_AUTOTUNING", "1")
    spec = select_spec(problem(), DEVICE, software=SOFTWARE, tuner=fake_tuner())
    err = capsys.readouterr().err
    key = make_key(problem(), DEVICE, SOFTWARE)
    assert key.id in err and spec.uri in err and " ms)" in err


def test_memo_hit_does_no_file_io(monkeypatch):
    spec = select_spec(problem(), DEVICE, software=SOFTWARE, tuner=fake_tuner())

    def no_io(*args, **kwargs):
        raise AssertionError("file I/O on a memo hit")

    import builtins
    import io
    import os
    import pathlib

    for target, name in (
        (builtins, "open"),
        (io, "open"),
        (os, "open"),
        (os, "stat"),
        (pathlib.Path, "read_text"),
        (pathlib.Path, "open"),
        (TuningDB, "load"),
    ):
        monkeypatch.setattr(target, name, no_io)
    assert select_spec(problem(), DEVICE, software=SOFTWARE, tuner=fake_tuner()) == spec


def test_warmup_pretunes_shapes():
    tuner, calls = counting_tuner()
    specs = warmup(
        ["1,8,8,512,512,64", (1, 8, 2, 2048, 2048, 64)],
        "fp16",
        causal=True,
        device=DEVICE,
        software=SOFTWARE,
        tuner=tuner,
    )
    assert len(specs) == 2 and all(s.dtype == "float16" and s.causal for s in specs)
    assert len(calls) == 2


def test_bfloat16_bits_round_to_nearest_even_and_widen_back():
    import numpy as np

    from kernelgen.tuning.gpu import bfloat16_bits

    rng = np.random.default_rng(3)
    x = np.concatenate(
        [rng.standard_normal(4096) * 10.0 ** rng.integers(-30, 30, 4096), [1.0, -2.5, 0.0]]
    ).astype(np.float32)
    bits = bfloat16_bits(np, x)
    assert bits.dtype == np.uint16
    widened = (bits.astype(np.uint32) << np.uint32(16)).view(np.float32).astype(np.float64)
    # the nearest bfloat16: within half a unit in the last place (8 significant bits)
    ulp = 2.0 ** (np.floor(np.log2(np.abs(x.astype(np.float64)) + 1e-300)) - 7)
    assert np.all(np.abs(widened - x) <= ulp / 2 * (1 + 1e-12))
    assert widened[-3:].tolist() == [1.0, -2.5, 0.0]
    # a tie goes to the even bfloat16: 1 + 2^-8 sits halfway between 1 and 1 + 2^-7
    tie = bfloat16_bits(np, np.array([1 + 2.0**-8, 1 + 3 * 2.0**-8], np.float32))
    assert tie.tolist() == [0x3F80, 0x3F82]


def test_as_element_rounds_float32_to_the_element_type():
    """float16 by astype (NumPy's RNE), float32 unchanged; the values widen back exactly where
    they were representable."""
    import numpy as np

    from kernelgen.tuning.gpu import as_element, as_float32

    x = np.array([1.0, -2.5, 1 + 2.0**-11, 65504.0, 1e-8], np.float32)
    half = as_element(np, x, "float16")
    assert half.dtype == np.float16
    assert as_float32(np, half).tolist() == [1.0, -2.5, 1.0, 65504.0, float(np.float16(1e-8))]
    assert as_element(np, x, "float32").tolist() == x.tolist()


def test_wgmma_candidates_only_for_16_bit_prefill_on_compute_capability_9_0():
    """Hopper specs (archs [sm_90a]) join the grid on a 9.0 device for fp16/bf16 prefill with a
    head dim they take, never on sm_80, for fp32 or other head dims; decode shapes get the
    Hopper decode grid instead (packed, split-KV: tests/test_tuning_decode.py)."""

    def wgmma(p, arch):
        specs, _ = valid_candidates(p, arch)
        return [s for s in specs if s.mma == "wgmma"]

    found = wgmma(problem(head_dim=128), "sm_90")
    assert found and all(
        s.archs == ("sm_90a",) and s.compile_arch("sm_90") == "sm_90a" for s in found
    )
    assert {s.block_m for s in found} == {64, 128}
    assert not wgmma(problem(head_dim=128), "sm_80")
    assert not wgmma(problem(head_dim=80), "sm_90")
    # head dim 192: 128 x 128 tiles do not fit in shared memory; its own 96 and 112 keys join
    tilings = {(s.block_m, s.block_n) for s in wgmma(problem(head_dim=192), "sm_90")}
    assert tilings == {(128, 64), (64, 128), (64, 64), (128, 96), (128, 112)}
    assert not wgmma(problem(dtype="float32"), "sm_90")
    decode = wgmma(problem(seqlen_q=1), "sm_90")
    assert decode and all(s.pack_gqa and s.block_m == 64 for s in decode)
    assert not wgmma(problem(seqlen_q=1), "sm_80")


H100 = DeviceInfo("NVIDIA H100 80GB HBM3", "9.0", 132)
A100 = DeviceInfo("NVIDIA A100-SXM4-80GB", "8.0", 108)


@pytest.mark.parametrize(
    ("head_dim", "block_n"), [(64, 128), (96, 64), (128, 128), (192, 96), (256, 64)]
)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_untuned_prefill_on_a_9_0_device_runs_the_hopper_kernel(dtype, head_dim, block_n):
    """Without tuning, a 9.0 device gets the wgmma kernel (1.24-1.81x the mma.sync kernel on an
    H100, bench/NOTES.md): two consumer warpgroups, the plain loop, 128-key tiles at d64/d128."""
    problem = ProblemDesc(dtype, 2, 16, 4, 4096, 4096, head_dim, causal=True)
    spec = heuristic_spec(problem, H100)
    assert (spec.mma, spec.block_m, spec.block_n, spec.overlap) == ("wgmma", 128, block_n, False)
    assert spec.archs == ("sm_90a",) and spec.causal and spec.dtype == dtype
    assert heuristic_spec(problem, A100).mma == "mma_sync"  # no wgmma before 9.0


@pytest.mark.parametrize(
    ("head_dim", "block_n", "causal", "held"),
    [
        (128, 128, False, True),  # d128 without causality: 48 KiB per unit (docs/hopper.md)
        (128, 128, True, False),  # causal: Q from shared memory until a GPU times the fix
        (96, 64, True, True),  # 64-key tiles re-read Q most: in registers either way
        (64, 128, False, False),  # d64: MUFU binds, Q traffic is no cost
        (256, 64, False, False),  # d256: no registers for Q
    ],
)
def test_where_the_untuned_hopper_kernel_holds_q_in_registers(head_dim, block_n, causal, held):
    spec = hopper_default_spec("bfloat16", head_dim, causal)
    assert (spec.block_n, spec.q_in_registers) == (block_n, held)


def test_block_mask_tiles_without_registers_for_q_keep_the_hopper_kernel():
    """A block mask built in 128 x 176 tiles at d128: Q in registers would need 184
    accumulators per thread, so the untuned spec reads Q from shared memory (still wgmma); 64 x
    64 tiles hold Q in registers; tiles no wgmma kernel takes give None (the mma.sync kernel)."""
    wide = hopper_default_spec("bfloat16", 128, False, tiles=(128, 176))
    assert wide is not None and (wide.block_n, wide.q_in_registers) == (176, False)
    narrow = hopper_default_spec("bfloat16", 128, False, tiles=(64, 64))
    assert narrow is not None and narrow.q_in_registers
    assert hopper_default_spec("bfloat16", 128, False, tiles=(32, 64)) is None


@pytest.mark.parametrize(
    "problem",
    [
        ProblemDesc("bfloat16", 2, 32, 8, 1, 4096, 128),  # decode: the split-KV kernel
        ProblemDesc("bfloat16", 2, 16, 16, 1024, 1024, 128, mask=True),  # an additive mask
        ProblemDesc("bfloat16", 2, 16, 16, 1024, 1024, 128, page_size=64),  # a paged cache
        ProblemDesc("float32", 2, 16, 16, 1024, 1024, 128),  # fp32: CUDA cores
        ProblemDesc("bfloat16", 2, 16, 16, 1024, 1024, 80),  # a head dim wgmma does not take
    ],
    ids=["decode", "mask", "paged", "fp32", "d80"],
)
def test_where_the_hopper_kernel_does_not_apply_the_policy_default_stays(problem):
    assert heuristic_spec(problem, H100).mma != "wgmma"


@pytest.mark.parametrize(
    ("rows", "group", "paged", "expected"),
    [
        (4, 4, False, (64, 128, True)),  # one consumer warpgroup, packed
        (64, 8, False, (64, 128, True)),
        (128, 32, False, (128, 128, True)),  # two consumers past 64 packed rows
        (3, 3, False, (64, 128, False)),  # group 3 divides no block_m: rows are not packed
        (4, 4, True, (64, 64, True)),  # paged: 64-key tiles (pages are multiples of 64)
    ],
)
def test_the_hopper_decode_spec(rows, group, paged, expected):
    """policy.hopper_decode_spec: what kg-decode-wg runs (not the untuned default: the decode
    problem above keeps the mma.sync split-KV kernel until a GPU has timed this one)."""
    spec = hopper_decode_spec("bf16", 128, False, rows, group, paged_kv=paged)
    assert (spec.block_m, spec.block_n, spec.pack_gqa) == expected
    assert spec.mma == "wgmma" and spec.split_kv and spec.paged_kv == paged
    assert hopper_decode_spec("float32", 128, False, rows, group) is None
    assert hopper_decode_spec("bfloat16", 80, False, rows, group) is None
