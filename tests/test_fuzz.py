"""The forward fuzzer (kernelgen.testing.fuzz): its draws are valid specs and problems the call
takes, the same for the same seed; its verdicts catch each kind of wrong output; and one small
fixed case replays through the emulator from the command line. CPU-cheap but for that one run
(CI is at its time budget): the sweeps themselves run by hand (docs/emulator.md)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kernelgen.errors import SpecError
from kernelgen.references.attention import LSE_TOLERANCE, OUT_TOLERANCE
from kernelgen.specs.forward import spec_from_dict
from kernelgen.testing import fuzz
from kernelgen.testing.fuzz_space import MAX_WORK, DrawStats, FuzzProblem, _work

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
            assert engine in ("all", spec.mma)
            for fields, problem in refused:
                with pytest.raises(SpecError) as error:
                    spec_from_dict(fields)
                assert error.value.problems[0] == problem
            p = case.problem
            assert p.heads % p.kv_heads == 0 and 1 <= p.batch <= 2
            assert min(p.seqlen_q, p.seqlen_k) >= 1
            assert _work(spec, p.batch, p.heads, p.seqlen_q, p.seqlen_k) <= MAX_WORK
            if spec.pack_gqa and spec.mma == "wgmma":  # the call's rule: the group divides block_m
                assert spec.block_m % (p.heads // p.kv_heads) == 0
            if p.seqlens_k is not None:
                assert len(p.seqlens_k) == p.batch
                assert all(0 <= n <= p.seqlen_k for n in p.seqlens_k)
            assert (p.page_size is not None) == spec.paged_kv
            assert (p.mask is not None) == spec.additive_mask
            assert (p.window is not None) == spec.window
            assert FuzzProblem.from_dict(p.to_dict()) == p
            assert fuzz.FuzzCase.from_json(case.to_json()) == case
            drawn.add(case.to_json())
    assert len(drawn) == len(SEEDS) * CASES  # seeds and indices give different cases
    assert sum(stats.drawn.values()) and stats.blamed  # some draws are refused, and counted


def test_the_space_reaches_every_field():
    """Over 150 wgmma and mma_sync cases every field the fuzzer draws is on in some valid spec."""
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


def test_bad_arguments_are_refused_by_name(capsys):
    with pytest.raises(SystemExit) as exit_:
        fuzz.main(["--replay", "{not json"])
    assert exit_.value.code == 2 and "--replay" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        fuzz.main(["--cases", "-1"])
    assert "--cases=-1" in capsys.readouterr().err


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
