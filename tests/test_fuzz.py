"""The forward fuzzer (kernelgen.testing.fuzz): its draws are valid specs and problems the call
takes, the same for the same seed; its verdicts catch each kind of wrong output; and one small
fixed case replays through the emulator from the command line. CPU-cheap but for that one run
(CI is at its time budget): the sweeps themselves run by hand (docs/emulator.md)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kernelgen.errors import SpecError
from kernelgen.families import spec_of_family
from kernelgen.references.attention import (
    LSE_TOLERANCE,
    OUT_TOLERANCE,
    attention_backward,
    grad_mismatches,
)
from kernelgen.references.fp8 import (
    DESCALE_NAMES,
    FP8_LSE_TOLERANCE,
    FP8_TOLERANCE,
    fp8_mismatches,
    fp8_reference,
    quantize,
)
from kernelgen.specs.backward import BackwardSpec
from kernelgen.specs.forward import FP8_BLOCK_N_BY_HEAD_DIM, spec_from_dict
from kernelgen.testing import fuzz, fuzz_backward
from kernelgen.testing.fuzz_space import MAX_WORK, DrawStats, FuzzProblem, work

SEEDS = (0, 1, 7)
CASES = 25


@pytest.mark.parametrize("engine", fuzz.ENGINES)
def test_draws_are_valid_reproducible_and_fit(engine):
    stats = DrawStats.empty()
    drawn = set()
    for seed in SEEDS:
        for index in range(CASES):
            case, refused = fuzz.draw_case(seed, index, engine, stats)
            again, refused_again = fuzz.draw_case(seed, index, engine)
            assert again.to_json() == case.to_json() and refused_again == refused
            spec = spec_from_dict(case.spec)
            assert engine in ("all", fuzz.case_label(case.spec))
            assert spec.fp8 == (fuzz.case_label(case.spec) == "fp8")
            for fields, problem in refused:
                with pytest.raises(SpecError) as error:
                    spec_from_dict(fields)
                assert error.value.problems[0] == problem
            p = case.problem
            assert p.heads % p.kv_heads == 0 and 1 <= p.batch <= 2
            assert min(p.seqlen_q, p.seqlen_k) >= 1
            assert work(spec, p.batch, p.heads, p.seqlen_q, p.seqlen_k) <= MAX_WORK
            if spec.pack_gqa and spec.mma == "wgmma":  # the call's rule: the group divides block_m
                assert spec.block_m % (p.heads // p.kv_heads) == 0
            if p.seqlens_k is not None:
                assert len(p.seqlens_k) == p.batch
                assert all(0 <= n <= p.seqlen_k for n in p.seqlens_k)
            assert (p.page_size is not None) == spec.paged_kv
            assert (p.mask is not None) == spec.additive_mask
            assert (p.window is not None) == spec.window
            assert (p.descales is not None) == spec.fp8
            if spec.fp8:  # what emulate_fp8_attention takes today: bhsd, every lse (seqlens_k too)
                assert set(p.descales) <= set(DESCALE_NAMES)
                assert p.layout == "bhsd" and not p.null_lse
            assert FuzzProblem.from_dict(p.to_dict()) == p
            assert fuzz.FuzzCase.from_json(case.to_json()) == case
            drawn.add(case.to_json())
    assert len(drawn) == len(SEEDS) * CASES  # seeds and indices give different cases
    assert sum(stats.drawn.values()) and stats.blamed  # some draws are refused, and counted


@pytest.mark.parametrize("engine", fuzz_backward.ENGINES)
def test_backward_draws_are_valid_reproducible_and_fit(engine):
    stats = DrawStats.empty()
    drawn = set()
    for seed in SEEDS:
        for index in range(CASES):
            case, refused = fuzz.draw_case(seed, index, engine, stats, "backward")
            again, refused_again = fuzz.draw_case(seed, index, engine, None, "backward")
            assert again.to_json() == case.to_json() and refused_again == refused
            spec = spec_of_family(case.spec)
            assert isinstance(spec, BackwardSpec) and engine in ("all", spec.mma)
            for fields, problem in refused:
                with pytest.raises(SpecError) as error:
                    spec_of_family(fields)
                assert error.value.problems[0] == problem
            p = case.problem
            assert p.heads % p.kv_heads == 0 and 1 <= p.batch <= 2
            assert p.seqlen_q >= 1 and p.seqlen_k >= 2  # rows see more than one key
            if spec.mask_mod is not None:  # and the document mask leaves them more than one
                assert p.seqlen_q >= 4 and p.seqlen_k >= 16
            if p.window is not None:
                assert p.window[0] != 0 or (p.window[1] != 0 and not spec.causal)
            assert work(spec, p.batch, p.heads, p.seqlen_q, p.seqlen_k) <= fuzz_backward.MAX_WORK
            assert (p.mask is not None) == spec.additive_mask
            assert (p.window is not None) == spec.window
            assert (p.softcap is not None) == spec.softcap
            assert p.seqlens_k is p.page_size is p.num_splits is p.descales is None
            assert fuzz.FuzzCase.from_json(case.to_json()) == case
            drawn.add(case.to_json())
    assert len(drawn) == len(SEEDS) * CASES
    assert sum(stats.drawn.values()) and stats.blamed


def test_the_space_reaches_every_field():
    """Over 150 wgmma and mma_sync cases every field the fuzzer draws is on in some valid spec;
    over 80 fp8 cases every fp8 head dim, key tile and loop, and descales given and not; over
    100 backward cases every backward field on both engines."""
    on: set[str] = set()
    for engine in ("wgmma", "mma_sync"):
        for index in range(75):
            case, _ = fuzz.draw_case(3, index, engine)
            on |= {name for name, value in case.spec.items() if value not in (False, None)}
            on |= {f"{name}={value}" for name, value in case.spec.items() if name == "epilogue"}
    wanted = {
        "causal", "window", "softcap", "alibi", "sinks", "additive_mask", "split_kv",
        "pack_gqa", "paged_kv", "block_sparse", "mask_mod", "overlap", "pingpong",
        "q_in_registers", "epilogue=tma", "cluster_m",
    }  # fmt: skip
    assert wanted <= on, wanted - on
    fp8 = [fuzz.draw_case(3, index, "fp8")[0] for index in range(80)]
    tiles = {(c.spec["head_dim"], c.spec["block_n"]) for c in fp8}
    assert tiles == {(d, n) for d, ns in FP8_BLOCK_N_BY_HEAD_DIM.items() for n in ns}
    loops = {
        name for c in fp8 for name in ("causal", "overlap", "q_in_registers") if c.spec.get(name)
    }
    assert loops == {"causal", "overlap", "q_in_registers"}
    assert any(c.spec.get("epilogue") == "tma" for c in fp8)
    assert {len(c.problem.descales) for c in fp8} >= {0, 3} and any(
        c.problem.heads > c.problem.kv_heads for c in fp8
    )
    on = set()
    for index in range(100):
        case, _ = fuzz.draw_case(3, index, "all", None, "backward")
        on |= {name for name, value in case.spec.items() if value not in (False, None)}
        on.add(f"mma={case.spec['mma']}")
    wanted = {
        "causal", "deterministic", "window", "softcap", "alibi", "sinks", "additive_mask",
        "mask_mod", "block_sparse", "score_mod", "split_roles", "mma=simt", "mma=mma_sync",
    }  # fmt: skip
    assert wanted <= on, wanted - on


# ---- verdicts: each kind of wrong output is a mismatch ---------------------------------------


def _inputs(ref_out, ref_lse):
    return fuzz.Inputs(None, None, None, None, {}, ref_out, ref_lse)  # type: ignore[arg-type]


def _reference():
    rng = np.random.default_rng(4)
    ref_out = rng.standard_normal((1, 2, 6, 8))
    ref_lse = rng.standard_normal((1, 2, 6))
    ref_out[0, 1, 2] = 0.0
    ref_lse[0, 1, 2] = -np.inf  # a row that sees no key
    return ref_out, ref_lse


def test_verdict_accepts_errors_within_the_limits():
    ref_out, ref_lse = _reference()
    out = ref_out * (1 + 0.5 * OUT_TOLERANCE["bfloat16"])
    verdict = fuzz.compare(
        out, ref_lse + 0.5 * LSE_TOLERANCE, _inputs(ref_out, ref_lse), "bfloat16"
    )
    assert verdict["outcome"] == "ok"
    assert 0.4 * OUT_TOLERANCE["bfloat16"] < verdict["out_error"] < 0.6 * OUT_TOLERANCE["bfloat16"]
    assert verdict["lse_error"] == pytest.approx(0.5 * LSE_TOLERANCE, rel=1e-3)


@pytest.mark.parametrize(
    "wrong, message",
    [
        (lambda o, s: (o * (1 + 3 * OUT_TOLERANCE["float16"]), s), "out relative error"),
        (lambda o, s: (np.where(o == 0, 1.0, o), s), "out = 0"),
        (lambda o, s: (np.where(o > 2, np.nan, o), s), "NaN in out"),
        (lambda o, s: (o, s + 2 * LSE_TOLERANCE), "lse error"),
        (lambda o, s: (o, np.where(np.isneginf(s), 0.0, s)), "lse is -inf"),
        (lambda o, s: (o, np.where(s > 1, np.nan, s)), "NaN in lse"),
    ],
    ids=["out", "empty-row", "nan-out", "lse", "lse-inf", "nan-lse"],
)
def test_verdict_catches_each_wrong_output(wrong, message):
    ref_out, ref_lse = _reference()
    out, lse = wrong(ref_out.copy(), ref_lse.copy())
    verdict = fuzz.compare(out, lse, _inputs(ref_out, ref_lse), "float16")
    assert verdict["outcome"] == "mismatch"
    assert any(message in line for line in verdict["failed"]), verdict["failed"]


def test_verdict_without_lse_judges_out_alone():
    ref_out, ref_lse = _reference()
    inputs = _inputs(ref_out, ref_lse)
    assert fuzz.compare(ref_out, None, inputs, "float16")["outcome"] == "ok"
    wrong = np.where(ref_out == 0, 1.0, ref_out)  # a row that sees no key gives out != 0
    assert fuzz.compare(wrong, None, inputs, "float16")["outcome"] == "mismatch"


def _fp8_reference():
    """fp8 data with two descales, causal with Sq = Sk + 2: rows 0 and 1 see no key."""
    rng = np.random.default_rng(2)
    q = quantize(rng.normal(0, 1.5, (1, 2, 9, 16)))
    k, v = (quantize(rng.normal(0, s, (1, 1, 7, 16))) for s in (1.5, 2.0))
    descales = {"k_descale": np.array([[0.5]]), "v_descale": np.array([[3.0]])}
    return fp8_reference(q, k, v, descales, causal=True, scale=0.25)


def test_fp8_verdict_accepts_errors_within_the_bound():
    ref = _fp8_reference()
    found = fp8_mismatches(ref.out * (1 + 2.0**-6), ref.lse + 0.5 * FP8_LSE_TOLERANCE, ref)
    assert not found.failed, found
    assert 0 < found.bound_ratio < 1 and 0 < found.out_error < FP8_TOLERANCE


@pytest.mark.parametrize(
    "wrong, message",
    [
        (lambda o, s: (o * (1 + 2.0**-3), s), "bound"),  # a weight off by twice e4m3's rounding
        (lambda o, s: (o * 1.5, s), "out relative error"),  # a descale applied twice, or not
        (lambda o, s: (np.where(o == 0, 1e-3, o), s), "bound"),  # a row that sees no key
        (lambda o, s: (np.where(o > 1, np.nan, o), s), "bound"),
        (lambda o, s: (o, s + 2 * FP8_LSE_TOLERANCE), "lse error"),
        (lambda o, s: (o, np.where(np.isneginf(s), 0.0, s)), "lse is -inf"),
        (lambda o, s: (o, np.where(s > 1, np.nan, s)), "NaN in lse"),
    ],
    ids=["out", "descale", "empty-row", "nan-out", "lse", "lse-inf", "nan-lse"],
)
def test_fp8_verdict_catches_each_wrong_output(wrong, message):
    ref = _fp8_reference()
    assert np.isneginf(ref.lse[0, :, :2]).all() and np.isfinite(ref.lse[0, :, 2:]).all()
    out, lse = wrong(ref.out.copy(), ref.lse.copy())
    found = fp8_mismatches(out, lse, ref)
    assert any(message in line for line in found.failed), found.failed


def _grads(sinks: bool):
    rng = np.random.default_rng(6)
    q, dout = rng.standard_normal((2, 1, 2, 5, 8))
    k, v = rng.standard_normal((2, 1, 1, 7, 8))
    extra = {"sinks": rng.standard_normal(2)} if sinks else {}
    return attention_backward(dout, q, k, v, causal=True, **extra)


def test_backward_verdict_accepts_the_reference_and_errors_within_the_limit():
    ref = _grads(sinks=True)
    grads = [ref.dq * (1 + 0.5 * OUT_TOLERANCE["float16"]), ref.dk, ref.dv, ref.dsinks]
    found = grad_mismatches(grads, ref, "float16")
    assert not found.failed and set(found.errors) == {"dq", "dk", "dv", "dsinks"}
    assert found.errors["dq"] == pytest.approx(0.5 * OUT_TOLERANCE["float16"])


@pytest.mark.parametrize(
    "wrong, message",
    [
        (lambda g: [g[0] * (1 + 3 * OUT_TOLERANCE["float16"]), *g[1:]], "dq relative error"),
        (lambda g: [g[0], np.where(g[1] == g[1].max(), np.nan, g[1]), g[2]], "non-finite dk"),
        (lambda g: [g[0], g[1], g[2][:, :, :-1]], "dv has shape"),
        (lambda g: [g[0], g[1], g[2], np.zeros(2)], "4 gradients"),
    ],
    ids=["dq", "nan-dk", "dv-shape", "dsinks-extra"],
)
def test_backward_verdict_catches_each_wrong_gradient(wrong, message):
    ref = _grads(sinks=False)
    found = grad_mismatches(wrong([ref.dq, ref.dk, ref.dv]), ref, "float16")
    assert any(message in line for line in found.failed), found.failed


def test_bad_arguments_are_refused_by_name(capsys):
    with pytest.raises(SystemExit) as exit_:
        fuzz.main(["--replay", "{not json"])
    assert exit_.value.code == 2 and "--replay" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        fuzz.main(["--cases", "-1"])
    assert "--cases=-1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        fuzz.main(["--family", "backward", "--engine", "fp8"])
    assert "--engine=fp8 is not allowed with --family=backward" in capsys.readouterr().err


# ---- one emulated case: a fixed small replay, GQA, ragged tiles, NaN past the lengths ---------
REPLAY = {
    "spec": dict(loop_order="v2", mma="wgmma", dtype="bfloat16", head_dim=64, block_m=64)
    | dict(block_n=48, stages=3, sinks=True),
    "problem": dict(batch=2, heads=2, kv_heads=1, seqlen_q=17, seqlen_k=49, layout="bshd")
    | dict(scale=-0.2, data_seed=5, seqlens_k=[49, 47], nan_past=True, wide_range=True),
}


@pytest.mark.emulate
def test_replay_of_a_fixed_case_runs_it_on_the_emulator(capsys):
    code = fuzz.main(["--replay", json.dumps(REPLAY)])
    line = json.loads(capsys.readouterr().out)
    assert code == 0 and line["outcome"] == "ok", line
    assert 0 < line["out_error"] <= OUT_TOLERANCE["bfloat16"]  # rounding shows; within limits
    assert 0 <= line["lse_error"] <= LSE_TOLERANCE
    assert line["case"] == json.loads(fuzz.FuzzCase.from_json(json.dumps(REPLAY)).to_json())


# One emulated case each of the fp8 forward and the backward: GQA, ragged tiles, descales given
# and not; a window with causal, bshd, deterministic dQ
FP8_REPLAY = {
    "spec": dict(loop_order="v2", mma="wgmma", dtype="float8_e4m3", head_dim=64, block_m=64)
    | dict(block_n=64, stages=2, causal=True, q_in_registers=True),
    "problem": dict(batch=1, heads=2, kv_heads=1, seqlen_q=17, seqlen_k=49, layout="bhsd")
    | dict(data_seed=8, descales=["q_descale", "v_descale"], wide_range=True),
}
BACKWARD_REPLAY = {
    "spec": dict(family="backward", mma="mma_sync", dtype="float16", head_dim=32, block_m=32)
    | dict(block_n=32, num_warps=2, stages=2, causal=True, window=True, deterministic=True),
    "problem": dict(batch=1, heads=2, kv_heads=1, seqlen_q=33, seqlen_k=40, layout="bshd")
    | dict(data_seed=9, window=[5, 3], scale=0.3),
}


@pytest.mark.emulate
@pytest.mark.parametrize("replay", [FP8_REPLAY, BACKWARD_REPLAY], ids=["fp8", "backward"])
def test_replay_of_a_fixed_fp8_and_backward_case(replay, capsys):
    code = fuzz.main(["--replay", json.dumps(replay)])
    line = json.loads(capsys.readouterr().out)
    assert code == 0 and line["outcome"] == "ok", line
    if "errors" in line:  # the backward: every gradient shows rounding, within the limit
        assert set(line["errors"]) == {"dq", "dk", "dv"}
        assert all(0 < e <= OUT_TOLERANCE["float16"] for e in line["errors"].values())
    else:
        assert 0 < line["bound_ratio"] <= 1 and 0 < line["out_error"] < FP8_TOLERANCE
        assert line["lse_error"] <= FP8_LSE_TOLERANCE
