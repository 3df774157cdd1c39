"""bench.tables, bench.calibration's comparison, the timing rounds and their statistics (CPU
only: result JSON, stored predictions and fake timers)."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import numpy as np
import pytest
from conftest import ROOT

from bench import calibration, harness, metrics, results_io, tables
from kernelgen.errors import InputError


# ---- the committed documents ---------------------------------------------------------------------
def test_tables_check_passes_on_the_committed_files():
    """Every generated section of NOTES.md, README.md, performance-model.md and calibration.md
    is what the generator writes from the committed result files (what CI checks)."""
    done = subprocess.run(
        [sys.executable, "-m", "bench.tables", "--check"], cwd=ROOT, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr


def test_every_timed_spec_has_a_stored_prediction():
    assert calibration.main(["--check"]) == 0


def test_notes_table_of_2026_11_25_is_the_retimed_rows():
    """0.99-1.05x torch flash, median 1.04x: kg-tc-v2's re-timed median over flash's, per
    shape, not the screening medians the hand-typed table quoted."""
    run = tables.load_run(ROOT / "bench" / "results" / tables.PREFILL_2026_11_25)
    ratios = [
        run.row(s, "torch-flash")["median_ms"] / run.row(s, "kg-tc-v2")["median_ms"]
        for s in run.shapes()
    ]
    assert (round(min(ratios), 2), round(max(ratios), 2)) == (0.99, 1.05)
    assert round(float(np.median(ratios)), 2) == 1.04
    notes = (ROOT / "bench" / "NOTES.md").read_text()
    assert "kg-tc-v2 / torch-flash: 0.99-1.05x (median 1.04x) over 8 shapes" in notes
    assert "commit 6b9a42d (dirty tree)" in notes


def test_wgmma_tables_take_the_commit_from_the_provenance_sidecar():
    notes = (ROOT / "bench" / "NOTES.md").read_text()
    section = notes.split("<!-- tables:begin wgmma-2026-11-26 -->")[1].split("<!-- tables:end")[0]
    assert section.count("commit 14b11b4 (per 2026-11-26-h100-provenance.json)") == 2
    assert "afee2ca" not in section


# ---- the generator's mechanics -------------------------------------------------------------------
def test_replace_section_and_its_errors():
    text = "a\n<!-- tables:begin x -->\nold\n<!-- tables:end x -->\nb\n"
    assert tables.replace_section(text, "x", "new\n") == (
        "a\n<!-- tables:begin x -->\nnew\n<!-- tables:end x -->\nb\n"
    )
    with pytest.raises(InputError, match="exactly one"):
        tables.replace_section("no markers", "x", "new")
    with pytest.raises(InputError, match="comes before"):
        tables.replace_section("<!-- tables:end x -->\n<!-- tables:begin x -->", "x", "new")


def test_check_reports_a_stale_section_and_an_unknown_marker(tmp_path):
    doc = tmp_path / "doc.md"
    doc.write_text("<!-- tables:begin t -->\nhand-typed\n<!-- tables:end t -->\n")
    sections = [tables.Section(doc, "t", lambda _r: "generated")]
    (current, generated, changed) = tables.render_documents(sections, tmp_path)[doc]
    assert changed == ["t"] and current != generated and "generated" in generated
    doc.write_text(generated)
    assert tables.render_documents(sections, tmp_path)[doc][2] == []
    doc.write_text(generated + "<!-- tables:begin other -->\n<!-- tables:end other -->\n")
    with pytest.raises(InputError, match="unknown table section"):
        tables.render_documents(sections, tmp_path)


def test_rewrite_keeps_the_documents_permissions(tmp_path):
    doc = tmp_path / "doc.md"
    doc.write_text("old")
    doc.chmod(0o664)
    tables.write_keeping_mode(doc, "new")
    assert doc.read_text() == "new" and doc.stat().st_mode & 0o777 == 0o664
    fresh = tmp_path / "fresh.md"
    tables.write_keeping_mode(fresh, "x")
    assert fresh.stat().st_mode & 0o777 == 0o644


def test_provenance_sidecar_overrides_meta(tmp_path):
    meta = {"git_commit": "a" * 40, "git_dirty": True}
    (tmp_path / "x-provenance.json").write_text(
        json.dumps({"runs": {"r": {"commit": "b" * 40, "files": ["2026-*-wgmma.json"]}}})
    )
    named = results_io.provenance(tmp_path / "2026-01-01-gpu-wgmma.json", meta)
    other = results_io.provenance(tmp_path / "2026-01-01-gpu.json", meta)
    assert (named.short, named.source) == ("bbbbbbb", "x-provenance.json")
    assert named.describe() == "commit bbbbbbb (per x-provenance.json)"
    assert other.describe() == "commit aaaaaaa (dirty tree)"
    (tmp_path / "y-provenance.json").write_text(json.dumps({"runs": {"r": {"files": []}}}))
    with pytest.raises(InputError, match="no 'commit'"):
        results_io.provenance(tmp_path / "z.json", meta)


def test_reader_takes_old_and_new_schemas_only(tmp_path):
    path = tmp_path / "r.json"
    for schema in (None, 1, 2):
        doc = {"meta": {}, "rows": []} | ({"schema": schema} if schema else {})
        path.write_text(json.dumps(doc))
        assert results_io.load_prefill(path)["rows"] == []
    path.write_text(json.dumps({"schema": 3, "meta": {}, "rows": []}))
    with pytest.raises(InputError, match="schema 3"):
        results_io.load_prefill(path)
    path.write_text(json.dumps({"rows": []}))
    with pytest.raises(InputError, match="no meta"):
        results_io.load_prefill(path)


def test_ratio_cell_calls_only_beyond_the_noise():
    fast = {"status": "ok", "median_ms": 1.0, "rounds": 3, "round_spread": 0.01}
    slow = {"status": "ok", "median_ms": 1.10, "rounds": 3, "round_spread": 0.02}
    noisy = {"status": "ok", "median_ms": 1.10, "rounds": 3, "round_spread": 0.2}
    assert tables.ratio_cell(fast, slow) == "1.10x (win)"
    assert tables.ratio_cell(slow, fast) == "0.91x (loss)"
    assert tables.ratio_cell(fast, noisy) == "1.10x (noise)"
    assert tables.ratio_cell(fast, {"status": "wrong"}) == "-"


# ---- statistics ----------------------------------------------------------------------------------
def test_rotation_starts_each_round_one_later():
    assert [metrics.rotation(3, r) for r in range(4)] == [
        [0, 1, 2],
        [1, 2, 0],
        [2, 0, 1],
        [0, 1, 2],
    ]
    assert metrics.rotation(0, 5) == []
    with pytest.raises(ValueError):
        metrics.rotation(-1, 0)


def test_round_budget_and_min_reps_keep_the_total():
    assert metrics.round_budget(500.0, 3) == pytest.approx(500.0 / 3)
    assert metrics.round_min_reps(20, 3) == 7 and metrics.round_min_reps(1, 3) == 1
    with pytest.raises(ValueError):
        metrics.round_budget(500.0, 0)


def test_round_stats_against_numpy():
    rounds = [[1.0, 1.2, 1.1, 0.9], [1.3, 1.4, 1.2], [1.0, 1.05]]
    everything = np.array([t for r in rounds for t in r], dtype=np.float64)
    stats = metrics.round_stats(rounds)
    assert stats["median_ms"] == pytest.approx(np.median(everything))
    assert stats["p10_ms"] == pytest.approx(np.percentile(everything, 10))
    assert stats["p90_ms"] == pytest.approx(np.percentile(everything, 90))
    medians = [float(np.median(r)) for r in rounds]
    assert stats["round_medians_ms"] == pytest.approx(medians)
    assert stats["round_spread"] == pytest.approx(
        (max(medians) - min(medians)) / np.median(everything)
    )
    assert stats["rounds"] == 3 and stats["reps"] == 9
    with pytest.raises(ValueError):
        metrics.round_stats([[], []])


def test_verdict_uses_round_spread_then_p10_p90():
    a = {"median_ms": 1.0, "rounds": 3, "round_spread": 0.02}
    b = {"median_ms": 1.05, "rounds": 3, "round_spread": 0.02}
    judged = metrics.verdict(a, b)
    assert judged["ratio"] == pytest.approx(1.05)
    assert judged["noise"] == pytest.approx(0.04) and judged["call"] == metrics.WIN
    assert metrics.verdict(b, a)["call"] == metrics.LOSS
    # a file without rounds: the p10-p90 width stands for the noise
    old_a = {"median_ms": 1.0, "p10_ms": 0.95, "p90_ms": 1.05}
    old_b = {"median_ms": 1.05, "p10_ms": 1.0, "p90_ms": 1.1}
    judged = metrics.verdict(old_a, old_b)
    assert judged["noise"] == pytest.approx(0.1 + 0.1 / 1.05)
    assert judged["call"] == metrics.WITHIN_NOISE and judged["noise_kind"] == metrics.NOISE_P10_P90
    assert metrics.verdict(a, {"median_ms": None})["call"] is None
    assert metrics.verdict(a, {"median_ms": 2.0})["call"] is None  # no noise figure


def test_spearman_against_numpy_ranks():
    xs = [3.0, 1.0, 2.0, 2.0, 5.0]
    ys = [30.0, 12.0, 11.0, 25.0, 40.0]
    rx = np.array([4, 1, 2.5, 2.5, 5], dtype=np.float64)  # ties share their average rank
    ry = np.array([4, 2, 1, 3, 5], dtype=np.float64)
    assert metrics.average_ranks(xs) == list(rx)
    assert metrics.spearman(xs, ys) == pytest.approx(np.corrcoef(rx, ry)[0, 1])
    assert metrics.spearman([1, 2, 3], [3, 2, 1]) == pytest.approx(-1.0)
    assert metrics.spearman([1.0], [2.0]) is None
    assert metrics.spearman([1, 1, 1], [1, 2, 3]) is None
    with pytest.raises(ValueError):
        metrics.spearman([1, 2], [1])


# ---- timing rounds with a fake timer -------------------------------------------------------------
class FakeTimer:
    """Records (entry, budget, min_reps) per call; entry i's times come from ``times[i]``."""

    def __init__(self, times: dict[str, list[list[float]]], fail: str | None = None):
        self.budget_ms, self.min_reps = 300.0, 20
        self.times, self.fail = times, fail
        self.calls: list[tuple[str, float, int]] = []

    def measure(self, fn, n_sets, budget_ms=None, min_reps=None):
        name = fn(0)
        self.calls.append((name, budget_ms, min_reps))
        if name == self.fail:
            raise RuntimeError(f"{name} broke")
        done = sum(1 for c in self.calls if c[0] == name)
        return self.times[name][done - 1], {"n_sets": n_sets}


def _figures(shape, times):
    return {"median_ms": float(np.median(times)), "reps": len(times), "shape": shape}


def test_round_timer_interleaves_in_rotating_order_on_a_share_of_the_budget():
    times = {
        "a": [[1.0, 1.1], [1.2, 1.3], [1.0, 1.0]],
        "b": [[2.0], [2.2], [2.1]],
        "c": [[3.0], [3.0], [3.3]],
    }
    timer = FakeTimer(times)
    rounds = harness.RoundTimer(timer, 3)
    targets = [{"peer": name} for name in "abc"]
    for target in targets[:2]:
        rounds.defer(target, "shape-1", lambda _i, n=target["peer"]: n, 2, None)
    rounds.defer(targets[2], "shape-1", lambda _i: "c", 2, 90.0)  # a candidate's own budget
    untouched = {"peer": "not pending"}
    rounds.finish([*targets, untouched], _figures)
    assert [c[0] for c in timer.calls] == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]
    budgets = {name: {c[1] for c in timer.calls if c[0] == name} for name in "abc"}
    assert budgets == {"a": {100.0}, "b": {100.0}, "c": {30.0}}
    assert {c[2] for c in timer.calls} == {7}
    a = targets[0]
    assert a["median_ms"] == pytest.approx(np.median([1.0, 1.1, 1.2, 1.3, 1.0, 1.0]))
    assert a["round_medians_ms"] == pytest.approx([1.05, 1.25, 1.0])
    assert a["round_spread"] == pytest.approx(0.25 / a["median_ms"])
    assert a["rounds"] == 3 and a["timing"]["reps_per_round"] == [2, 2, 2]
    assert "_pending" not in a and untouched == {"peer": "not pending"}


def test_round_timer_errors_go_to_the_handler_or_raise():
    timer = FakeTimer({"a": [[1.0]] * 3}, fail="b")
    rounds = harness.RoundTimer(timer, 3)
    targets = [{"peer": "a"}, {"peer": "b"}]
    for target in targets:
        rounds.defer(target, "s", lambda _i, n=target["peer"]: n, 1)
    failed = []
    rounds.finish(targets, _figures, lambda t, exc: failed.append((t["peer"], str(exc))))
    assert failed == [("b", "b broke")]
    assert [c[0] for c in timer.calls].count("b") == 1  # left out of the later rounds
    assert targets[0]["rounds"] == 3
    lone = {"peer": "b"}
    rounds.defer(lone, "s", lambda _i: "b", 1)
    with pytest.raises(harness.TimingError, match="b broke"):
        rounds.finish([lone], _figures)
    with pytest.raises(ValueError):
        harness.RoundTimer(timer, 0)


def test_interleave_lets_fatal_errors_through():
    class FatalError(Exception):
        pass

    def boom(entry, _round):
        raise FatalError

    with pytest.raises(FatalError):
        harness.interleave(2, 2, boom, (FatalError,))


def test_parse_clocks_and_missing_nvidia_smi():
    text = "1980, 2619, 1980, 2619, 41, 120.55, 0x0000000000000000\n"
    clocks = harness.parse_clocks(text)
    assert clocks["clocks.sm"] == 1980.0 and clocks["clocks.mem"] == 2619.0
    assert clocks["power.draw"] == pytest.approx(120.55)
    assert clocks["clocks_throttle_reasons.active"] == 0
    partial = harness.parse_clocks("1755, 2619, 1980, 2619, 70, [N/A], 0x4\n")
    assert partial["power.draw"] is None and partial["clocks_throttle_reasons.active"] == 4
    assert harness.parse_clocks("") is None and harness.parse_clocks("1, 2\n") is None

    def missing(*_a, **_k):
        raise FileNotFoundError("nvidia-smi")

    assert harness.gpu_clocks(run=missing) is None


# ---- calibration on a tiny synthetic result file -------------------------------------------------
def _cand(label, ms, mma="mma_sync", block_n=64):
    fields = {"mma": mma, "block_n": block_n, "head_dim": 128}
    return {"label": label, "status": "ok", "spec_uri": f"u-{label}", "fields": fields,
            "median_ms": ms, "tflops": 100.0 / ms, "p10_ms": ms, "p90_ms": ms}  # fmt: skip


def _synthetic(tmp_path):
    rows = [
        {"shape": "s1", "peer": "kg-tc-v2", "head_dim": 128, "dtype": "bfloat16",
         "best_label": "b", "candidates": [
             _cand("a", 2.0), _cand("b", 1.0), _cand("c", 4.0),
             {"label": "bad", "status": "invalid", "fields": {}}]},
        {"shape": "s1", "peer": "kg-wgmma", "head_dim": 128, "dtype": "bfloat16",
         "best_label": "w",
         "candidates": [_cand("w", 1.0, "wgmma"), _cand("w-ovl", 1.25, "wgmma")]},
        {"shape": "s1", "peer": "torch-flash", "head_dim": 128, "dtype": "bfloat16"},
    ]  # fmt: skip
    doc = {
        "schema": 1,
        "meta": {"template_hash": "f" * 64, "compute_capability": "90"},
        "floors": {"matmul_tflops": {"bfloat16": 200.0}},
        "rows": rows,
    }
    path = tmp_path / "2026-01-01-nvidia-x.json"
    path.write_text(json.dumps(doc))
    return path


def test_calibration_of_a_synthetic_result_file(tmp_path):
    measured = calibration.all_measured(_synthetic(tmp_path).parent)
    assert [(m.peer, m.label, m.arch) for m in measured] == [
        ("kg-tc-v2", "a", "sm_90"),
        ("kg-tc-v2", "b", "sm_90"),
        ("kg-tc-v2", "c", "sm_90"),
        ("kg-wgmma", "w", "sm_90a"),
        ("kg-wgmma", "w-ovl", "sm_90a"),
    ]
    assert [m.winner for m in measured] == [False, True, False, True, False]
    # model: a 512, b 1024 (ranks a before b, the reverse of the measurement), c 2048; tuner
    # (tiling-only) gets the order right; the overlapped wgmma tiling predicted 10% faster
    cost = {"a": (512, 600), "b": (1024, 500), "c": (2048, 2048)}
    cost |= {"w": (550, 512), "w-ovl": (500, 512)}
    models = {
        m.model_key: {"cost_clocks": cost[m.label][0], "analytic_cost_clocks": cost[m.label][1]}
        for m in measured
    }
    calibrated = calibration.calibrate(measured, models)
    b = calibrated[1]
    assert b.predicted_fraction == pytest.approx(512 / 1024)  # 2*64*64*128/2048 = 512 clocks
    assert b.measured_fraction == pytest.approx(100.0 / 200.0)
    assert calibrated[2].efficiency == pytest.approx((25.0 / 200.0) / (512 / 2048))
    fits = {f.peer: f for f in calibration.group_fits(calibrated)}
    tc = fits["kg-tc-v2"]
    assert tc.count == 3 and tc.best_label == "b"
    assert tc.model_rho == pytest.approx(np.corrcoef([1, 2, 3], [2, 1, 3])[0, 1])
    assert tc.tuner_rho == pytest.approx(1.0)
    assert (tc.model_first, tc.model_first_slowdown) == ("a", 2.0)
    assert (tc.tuner_first, tc.tuner_first_slowdown) == ("b", 1.0)
    (pair,) = calibration.overlap_pairs(calibrated)
    assert pair.measured_ratio == pytest.approx(1.0 / 1.25)
    assert pair.predicted_ratio == pytest.approx(550 / 500)
    words = tables.calibration_summary_section(calibrated)
    assert "measured slower than the same tiling without it in 1 of 1 pairs" in words
    assert "first choice was the measured fastest in 0 of 2 rows, the autotuner's in 2" in words


def test_calibration_check_names_specs_without_a_prediction(tmp_path, capsys):
    path = _synthetic(tmp_path)
    assert calibration.main(["--check", "--results", str(path.parent)]) == 1
    assert "no stored prediction for ffffffffffff/sm_90/u-a" in capsys.readouterr().err
    measured = calibration.all_measured(path.parent)
    calibration.save_models(
        {m.model_key: {"cost_clocks": 1.0, "analytic_cost_clocks": 1.0} for m in measured},
        path.parent / "calibration.json",
    )
    assert calibration.main(["--check", "--results", str(path.parent)]) == 0
    assert math.isclose(calibration.ideal_clocks(64), 256.0)
