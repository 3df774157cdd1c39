"""CPU tests of the backward benchmark (bench/backward.py): its cases, FLOP count, peers, the
command line (--help, --list, --dry-run, no GPU) and the runner's control flow on fakes (check,
both timed modes, the report). No torch, CuPy or GPU is needed."""

from __future__ import annotations

import datetime as dt
import importlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from bench import backward, gpu, report
from bench.harness import RoundTimer
from bench.shapes import Shape

ROOT = Path(__file__).resolve().parent.parent


def args(*flags: str):
    return backward.parse_args(list(flags))


def plain(
    seqlen: int = 2048, causal: bool = False, head_dim: int = 128, dtype: str = "bfloat16"
) -> backward.BackwardCase:
    heads = 32 if head_dim <= 64 else 16
    return backward.BackwardCase(
        Shape(dtype, head_dim, causal, seqlen, seqlen, 16384 // seqlen, heads)
    )


# ---- cases, FLOPs and peers ----------------------------------------------------------------
def test_full_grid_and_quick_cases():
    cases = backward.select_cases(args())
    keys = [c.key for c in cases]
    assert len(cases) == 2 * 2 * 5 + 2 * 5  # d64/d128 x causal x 1k..16k, two variants x 5
    assert keys[0] == "bf16-d64-s1024" and "bf16-d128-s16384-causal" in keys
    assert all(c.batch * c.seqlen_q == 16384 for c in cases)
    variants = [c for c in cases if c.variant]
    assert {c.variant for c in variants} == {"document", "softcap"}
    assert all(c.causal and c.head_dim == 128 and c.dtype == "bfloat16" for c in variants)
    quick = [c.key for c in backward.select_cases(args("--quick"))]
    assert quick == [
        "bf16-d128-s2048",
        "bf16-d128-s2048-causal",
        "document-bf16-d128-s2048-causal",
        "softcap-bf16-d128-s2048-causal",
    ]


def test_filters_and_names():
    cases = backward.select_cases(
        args("--dtype", "fp16", "--head-dim", "64", "--seqlen", "4096", "--causal")
    )
    assert [c.key for c in cases] == [
        "fp16-d64-s4096-causal",
        "document-bf16-d128-s4096-causal",
        "softcap-bf16-d128-s4096-causal",
    ]
    only_variants = backward.select_cases(args("--quick", "--peers", "none"))
    assert [c.variant for c in only_variants] == ["document", "softcap"]
    no_variants = backward.select_cases(args("--quick", "--variants", "none"))
    assert all(c.variant is None for c in no_variants)
    with pytest.raises(ValueError, match="unknown peer"):
        backward.select_cases(args("--peers", "torch-flash,kg-fast"))
    with pytest.raises(ValueError, match="unknown variant"):
        backward.select_cases(args("--variants", "alibi"))
    with pytest.raises(ValueError, match="no cases"):
        backward.select_cases(args("--peers", "none", "--variants", "none"))


def test_peer_list():
    assert backward.PEER_NAMES == ("torch-flash", "torch-cudnn", "kg-atomic", "kg-det", "flex")
    assert backward.VARIANT_PEERS == ("kg-atomic", "kg-det", "flex")
    assert backward.peers_of(plain(), args()) == list(backward.PEER_NAMES)
    assert backward.peers_of(plain(), args("--peers", "flex,torch-flash")) == [
        "torch-flash",
        "flex",
    ]  # the benchmark's order, not the flag's
    document = backward.variant_cases(["document"], [2048])[0]
    assert backward.peers_of(document, args("--peers", "torch-cudnn")) == list(
        backward.VARIANT_PEERS
    )
    assert backward.peers_of(document, args("--variant-peers", "flex")) == ["flex"]
    with pytest.raises(ValueError, match="unknown variant peer"):
        backward.peers_of(document, args("--variant-peers", "torch-flash"))


def test_a_missing_library_makes_a_peer_unavailable():
    try:
        try:
            raise ModuleNotFoundError("No module named 'triton'")
        except ImportError as exc:
            raise RuntimeError("backend compiler failed") from exc
    except RuntimeError as chained:
        assert backward._missing(chained)
    assert backward._missing(RuntimeError("Cannot find a working triton installation."))
    assert not backward._missing(RuntimeError("CUDA out of memory"))


def test_flops_follow_the_flashattention_convention():
    case = plain(seqlen=4096, head_dim=128)  # B=4, H=16
    forward = 4 * 4 * 16 * 4096 * 4096 * 128
    assert backward.forward_flops(case) == forward
    assert backward.mode_flops(case, backward.BWD) == 2.5 * forward
    assert backward.mode_flops(case, backward.FWD_BWD) == 3.5 * forward
    causal = plain(seqlen=4096, causal=True)
    assert backward.mode_flops(causal, backward.BWD) == 2.5 * forward / 2
    document, softcap = backward.variant_cases(["document", "softcap"], [4096])
    length = 4096 // backward.DOCUMENTS  # a causal block per document
    want = 4 * 4 * 16 * 128 * backward.DOCUMENTS * length * length / 2
    assert backward.forward_flops(document) == want
    assert backward.forward_flops(softcap) == forward / 2
    assert document.key == "document-bf16-d128-s4096-causal"
    assert document.as_dict()["variant"] == "document" and document.heads == 16


def test_bytes_of_sets_gradients_and_floors():
    case = plain(seqlen=1024, head_dim=64)  # B=16, H=32: each tensor 64 MiB
    tensor = 16 * 32 * 1024 * 64 * 2
    lse = 4 * 16 * 32 * 1024
    assert backward.set_bytes(case) == 4 * tensor  # q, k, v, dout
    assert backward.grad_bytes(case) == 3 * tensor
    # reads q, k, v, out, dout, lse; writes dq, dk, dv
    assert backward.min_bytes(case, backward.BWD) == 8 * tensor + lse
    assert backward.min_bytes(case, backward.FWD_BWD) == 8 * tensor + lse + 4 * tensor + lse


# ---- the command line ----------------------------------------------------------------------
def test_help_list_and_bad_flags(capsys):
    with pytest.raises(SystemExit) as done:
        backward.main(["--help"])
    assert done.value.code == 0
    text = capsys.readouterr().out
    for flag in ("--quick", "--out", "--peers", "--variants", "--dry-run", "--simt-max-seqlen"):
        assert flag in text
    assert backward.main(["--list", "--quick"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("4 backward cases") and "softcap-bf16-d128-s2048-causal" in out
    assert "peers kg-atomic,kg-det,flex" in out and "2.5x forward" in out
    assert backward.main(["--dtype", "fp8"]) == 2
    assert "fp8" in capsys.readouterr().err


def test_dry_run_builds_and_renders_every_kernelgen_spec(capsys):
    assert backward.main(["--dry-run", "--quick"]) == 0
    out = capsys.readouterr().out
    assert out.count(" ok fa_bwd_") == 8  # 4 cases x atomic and deterministic
    # the policy's tensor-core default for bf16 (16-byte aligned rows, sm_80 and later)
    assert re.search(r"kg-det     ok fa_bwd_tc_bf16_d128_\w+_causal_cap_det\n", out)
    assert "_mmod" in out  # the document case's mask_mod is compiled in


def test_run_without_gpu_is_one_line(tmp_path, capsys, monkeypatch):
    def no_gpu() -> None:
        raise gpu.NoGPUError("torch is not installed")

    monkeypatch.setattr(gpu, "open_gpu", no_gpu)
    assert backward.main(["--quick", "--out", str(tmp_path)]) == 2
    assert capsys.readouterr().err.strip() == "bench: no usable GPU: torch is not installed"
    assert not any(tmp_path.iterdir())


def test_cli_without_a_device_exits_2(tmp_path):
    """The real path: torch without CUDA (or no torch) is one line and exit status 2."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run(
        [sys.executable, "-m", "bench.backward", "--quick", "--out", str(tmp_path)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("bench: no usable GPU: ")
    assert not any(tmp_path.iterdir())


# ---- the runner on fakes -------------------------------------------------------------------
class FakeEnv:
    """What BackwardRunner touches without a GPU."""

    def __init__(self) -> None:
        import kernelgen

        self.kernelgen, self.kernelgen_error = kernelgen, None
        self.torch = SimpleNamespace(cuda=SimpleNamespace())  # no _sleep: no calibration
        self.info = {"sm_count": 132, "l2_bytes": 50 << 20, "gpu_name": "Fake GPU"}
        self.arch = "sm_90"

    def kg_module(self, name: str) -> Any:
        return importlib.import_module(f"kernelgen.{name}")

    def sync(self) -> None:
        pass


class FakeTimer:
    budget_ms, min_reps = 100.0, 4

    def measure(self, fn, n_sets, budget_ms=None, min_reps=None):
        for i in range(n_sets):
            fn(i)
        return [2.0, 2.0], {"n_sets": n_sets}


class FakeGrads(backward.GradImpl):
    """Gradients as labels ("good", "bad"); what ran is logged."""

    def __init__(self, peer: str, sets: list, full: str = "good", alone: str = "good") -> None:
        super().__init__(peer, sets)
        self.full, self.alone, self.log = full, alone, []

    def save(self, i: int) -> None:
        self.saved[i] = f"graph {i}"
        self.log.append(("save", i))

    def backward(self, i: int) -> tuple:
        assert i in self.saved, "backward alone needs the saved forward"
        self.log.append(("bwd", i))
        return (self.alone,) * 3

    def forward_backward(self, i: int) -> tuple:
        self.log.append(("fwd+bwd", i))
        return (self.full,) * 3


@pytest.fixture
def runner(monkeypatch):
    monkeypatch.setattr(gpu, "relative_error", lambda env, got, want: (1e-3, 0) if got == "good"
                        else (None, 7) if got == "nan" else (0.5, 0))  # fmt: skip
    monkeypatch.setattr(gpu, "poison_allocators", lambda env, nbytes: None)
    monkeypatch.setattr(gpu, "extra_memory", lambda env, impl, q, k, v, out: 1234)
    monkeypatch.setattr(gpu, "release", lambda env: None)
    monkeypatch.setattr(backward, "make_sets", lambda env, case, n, seed: [("set",) * 4] * n)
    monkeypatch.setattr(backward, "reference_grads", lambda env, case, s: ("ref",) * 3)
    r = backward.BackwardRunner(FakeEnv(), args("--quick"), {})
    r.floors = {"matmul_tflops": {"bfloat16": 700.0}, "copy_gbps": 3000.0}
    r.rounds = RoundTimer(FakeTimer(), 2, (gpu.FatalGPUError,))
    return r


def test_shape_rows_check_then_time_both_modes(runner, monkeypatch, capsys):
    impls = {
        "torch-flash": FakeGrads("torch-flash", []),
        "torch-cudnn": FakeGrads("torch-cudnn", [], alone="bad"),  # the saved-graph path
        "kg-atomic": FakeGrads("kg-atomic", []),
        "kg-det": FakeGrads("kg-det", [], full="nan"),
    }

    def row(case, peer, sets, ref):
        if peer == "flex":
            return report.make_row(case, peer, report.UNAVAILABLE, reason="no triton")
        impls[peer].sets = sets
        return runner.guarded(case, peer, lambda: impls[peer], sets, ref)

    monkeypatch.setattr(runner, "torch_row", row)
    monkeypatch.setattr(runner, "kernelgen_row", row)
    case = plain(seqlen=2048)
    rows = {r["peer"]: r for r in runner.shape_rows(case)}
    assert list(rows) == list(backward.PEER_NAMES)
    flash = rows["torch-flash"]
    assert flash["status"] == report.OK and flash["rel_err"] == 1e-3
    assert flash["n_sets"] == 2 and flash["extra_mem_bytes"] == 1234
    bwd_flops = backward.mode_flops(case, backward.BWD)
    assert flash["median_ms"] == 2.0 and flash["tflops"] == pytest.approx(bwd_flops / 2e-3 / 1e12)
    assert flash["frac_of_matmul"] == pytest.approx(flash["tflops"] / 700.0)
    both = flash["fwd_bwd"]
    assert both["mode"] == backward.FWD_BWD and both["tflops"] == pytest.approx(
        backward.mode_flops(case, backward.FWD_BWD) / 2e-3 / 1e12
    )
    assert "_pending" not in flash and "_pending" not in both
    # every set's forward saved before the timing; backward alone only ever on a saved one
    log = impls["torch-flash"].log
    assert ("save", 1) in log and log.count(("fwd+bwd", 1)) == 2  # two rounds
    cudnn = rows["torch-cudnn"]
    assert cudnn["status"] == report.WRONG and cudnn["reason"].startswith("bwd: rel. error 0.5")
    assert "median_ms" not in cudnn
    det = rows["kg-det"]
    assert det["reason"] == "fwd+bwd: 21 non-finite gradient elements"  # 7 in each
    assert rows["flex"]["status"] == report.UNAVAILABLE
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 5 and "fwd+bwd" in lines[0]
    table = backward.markdown_table(list(rows.values()))
    cells = [c.strip() for c in table.splitlines()[2].split("|")[1:-1]]
    rate, full = flash["tflops"], both["tflops"]
    assert cells[:3] == ["bf16-d128-s2048", "8x16", f"{rate:.1f} / {full:.1f}"]
    assert cells[3] == "WRONG 5.0e-01" and cells[6] == "n/a"
    assert cells[-2:] == ["1.00x", "-"]  # kg-atomic over flash; kg-det not timed


def test_a_peer_that_raises_is_an_error_row(runner, monkeypatch):
    def boom(case, peer, sets, ref):
        raise RuntimeError("compile failed\nmore")

    monkeypatch.setattr(runner, "torch_row", boom)
    row = runner.peer_row(plain(), "torch-flash", [], None)
    assert row["status"] == report.ERROR and row["reason"] == "RuntimeError: compile failed"
    assert row["label"].startswith("torch SDPA FLASH_ATTENTION")

    def fatal(case, peer, sets, ref):
        raise gpu.FatalGPUError("context gone")

    monkeypatch.setattr(runner, "kernelgen_row", fatal)
    with pytest.raises(gpu.FatalGPUError):
        runner.peer_row(plain(), "kg-atomic", [], None)


def test_kernelgen_rows_skip_the_cuda_core_kernel_past_the_limit(runner):
    case = plain(seqlen=8192, dtype="float32")  # fp32: the CUDA-core engine
    row = runner.kernelgen_row(case, "kg-det", [], None)
    assert row["status"] == report.SKIPPED and "--simt-max-seqlen 4096" in row["reason"]
    assert row["spec_uri"] == "fa_bwd_simt_f32_d128_m32_n32_w4_det"


def test_run_writes_results_and_merges(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(gpu, "open_gpu", FakeEnv)
    floors = {"matmul_tflops": {"bfloat16": 700.0, "float16": 690.0}, "copy_gbps": 3000.0}
    monkeypatch.setattr(gpu, "measure_floors", lambda env, timer: floors)
    monkeypatch.setattr(backward, "git_info", lambda: {"git_commit": "abc", "git_dirty": False})
    monkeypatch.setenv("KERNELGEN_AUTOTUNE", "0")

    def shape_rows(self, case):
        fields = {"median_ms": 1.0, "tflops": 100.0, "fwd_bwd": {"tflops": 120.0}}
        return [report.make_row(case, "kg-atomic", report.OK, **fields)]

    monkeypatch.setattr(backward.BackwardRunner, "shape_rows", shape_rows)
    out = ["--out", str(tmp_path), "--variants", "none", "--head-dim", "128", "--no-causal"]
    assert backward.main([*out, "--seqlen", "1024"]) == 0
    stem = f"{dt.date.today().isoformat()}-fake-gpu-backward"
    data = json.loads((tmp_path / f"{stem}.json").read_text())
    assert data["meta"]["benchmark"] == "backward" and data["floors"] == floors
    assert data["meta"]["flops"] == backward.FLOP_CONVENTION
    assert [r["shape"] for r in data["rows"]] == ["bf16-d128-s1024"]
    assert backward.main([*out, "--seqlen", "4096", "--merge"]) == 0
    data = json.loads((tmp_path / f"{stem}.json").read_text())
    assert [r["shape"] for r in data["rows"]] == ["bf16-d128-s1024", "bf16-d128-s4096"]
    md = (tmp_path / f"{stem}.md").read_text()
    assert md.startswith("# Attention backward benchmark: Fake GPU")
    assert "| bf16-d128-s4096 | 4x16 | - | - | 100.0 / 120.0 | - | - |" in md
    assert "retain_graph=True" in md and "KERNELGEN_AUTOTUNE=0" in md
    assert "wrote" in capsys.readouterr().out
