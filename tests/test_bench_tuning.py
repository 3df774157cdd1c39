"""CPU tier: the arithmetic and report of the autotuner benchmark (bench.tuning)."""

from __future__ import annotations

import math

import pytest

from bench import tuning


def test_choice_ratio_against_the_exhaustive_best():
    retimed = {"a@4splits": 1.10, "b": 1.00, "c": math.inf, "d": 1.00}
    ratio, best = tuning.choice_ratio(1.10, retimed)
    assert best == "b"  # ties broken by label; inf (failed) ignored
    assert ratio == pytest.approx(1.10)
    assert tuning.choice_ratio(None, retimed) == (None, "")
    assert tuning.choice_ratio(1.0, {"x": math.inf}) == (None, "")


@pytest.mark.parametrize(
    ("value", "limit", "expected"),
    [(1.02, 1.03, "PASS"), (1.03, 1.03, "PASS"), (1.031, 1.03, "MISS"), (None, 1.0, "not measured"),
     (math.nan, 1.0, "not measured")],
)  # fmt: skip
def test_verdict(value, limit, expected):
    assert tuning.verdict(value, limit) == expected


def test_target_lines_take_the_worst_shape():
    rows = [
        {"shape": "a", "choice_ratio": 1.01, "tune_s": 4.0},
        {"shape": "b", "choice_ratio": 1.05, "tune_s": 12.5},
        {"shape": "c", "reason": "RuntimeError: boom"},
    ]
    lines = tuning.target_lines(rows, {"overhead_us": 6.2})
    assert lines[0].startswith("- MISS") and "1.050" in lines[0] and "over 3 shapes" in lines[0]
    assert lines[1].startswith("- MISS") and "12.5 s" in lines[1]
    assert lines[2].startswith("- PASS") and "6.2 us" in lines[2]
    none = tuning.target_lines([], None)
    assert all(line.startswith("- not measured") for line in none)


def test_markdown_document_lists_rows_overhead_and_targets():
    result = {
        "meta": {"date": "2026-11-23", "gpu_name": "Fake GPU"},
        "rows": [
            {
                "shape": "bf16-b1-h32kv8-q1-k32768-d128",
                "tune_s": 7.25,
                "timed": 18,
                "winner": "fa_x@40splits",
                "winner_ms": 0.05,
                "best": "fa_x@40splits",
                "choice_ratio": 1.0,
            }
        ],
        "overhead": {
            "shape": "s",
            "attention_us": 20.0,
            "direct_us": 9.5,
            "overhead_us": 10.5,
            "calls": 2000,
            "rounds": 5,
        },
    }
    text = tuning.markdown_document(result)
    assert "| bf16-b1-h32kv8-q1-k32768-d128 | 7.2 | 18 | fa_x@40splits | 0.0500 |" in text
    assert "+10.5 us" in text and "- PASS: a cached attention()" in text
    assert "|---|---:|---:|---|---:|---|---:|" in text  # a markdown delimiter row


def test_shapes_and_list(capsys):
    assert tuning.TuneShape("bf16", 1, 32, 8, 1, 32768, 128).text == "1,32,8,1,32768,128"
    assert len({s.key for s in tuning.FULL}) == len(tuning.FULL)
    assert tuning.main(["--list"]) == 0
    out = capsys.readouterr().out
    assert all(s.key in out for s in tuning.FULL) and "overhead:" in out


def test_cold_tuning_runs_in_a_fresh_process_with_empty_caches(tmp_path, monkeypatch):
    """CuPy reads CUPY_CACHE_DIR at import and memoizes loaded modules: only a new process
    with the variable set from the start is cold. This process's environment is left alone."""
    import json
    import os
    import subprocess
    import sys

    before = dict(os.environ)
    calls = []

    def fake_run(argv, **kwargs):
        calls.append((argv, kwargs))
        return subprocess.CompletedProcess(argv, 0, 'progress\n{"tune_s": 4.5, "winner": "w"}\n')

    monkeypatch.setattr(tuning.subprocess, "run", fake_run)
    shape = tuning.QUICK[1]
    assert tuning.cold_tune(shape, tmp_path / "x") == {"tune_s": 4.5, "winner": "w"}
    ((argv, kwargs),) = calls
    assert argv[:4] == [sys.executable, "-m", "bench.tuning", "--cold-tune"]
    assert tuning.TuneShape(**json.loads(argv[4])) == shape
    env = kwargs["env"]
    assert env["CUPY_CACHE_DIR"] == str(tmp_path / "x" / "cupy")
    assert env["KERNELGEN_CACHE_DIR"] == str(tmp_path / "x" / "kernelgen")
    assert not (tmp_path / "x").exists()  # empty: nothing there before the child runs
    assert dict(os.environ) == before


def test_a_failed_cold_tuning_names_its_last_error(tmp_path, monkeypatch):
    import subprocess

    def fake_run(argv, **kwargs):
        return subprocess.CompletedProcess(argv, 1, "", "Traceback\nRuntimeError: no GPU\n")

    monkeypatch.setattr(tuning.subprocess, "run", fake_run)
    with pytest.raises(RuntimeError, match="cold tuning exited 1: RuntimeError: no GPU"):
        tuning.cold_tune(tuning.QUICK[0], tmp_path)


def test_the_child_prints_one_json_line(monkeypatch, capsys):
    import json

    seen = []
    monkeypatch.setattr(tuning, "cold_tune_here", lambda s: seen.append(s) or {"tune_s": 1.0})
    shape = tuning.FULL[2]
    assert tuning.main(["--cold-tune", json.dumps(vars(shape))]) == 0
    assert seen == [shape] and json.loads(capsys.readouterr().out) == {"tune_s": 1.0}
