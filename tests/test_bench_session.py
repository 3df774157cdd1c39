"""bench.session: the plan fits the window, the dry run passes here (no GPU), the stamp tells a
clean tree from a changed one, and a stage cut at its budget still leaves its log bundled."""

from __future__ import annotations

import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from bench import session

ROOT = Path(__file__).resolve().parent.parent


def test_the_plan_fits_the_window_in_priority_order():
    stages = session.plan()
    assert sum(s.budget_s for s in stages) <= session.WINDOW_S == 480
    names = [s.name for s in stages]
    assert names.index("correctness") < names.index("memcheck") < names.index("prefill")
    assert names.index("prefill") < names.index("fp8-prefill") < names.index("decode")
    assert all(s.dry_command is not None for s in stages)
    fp8 = stages[names.index("fp8-prefill")]  # the fp8 loops: never timed one by one yet
    assert "kg-wgmma-fp8" in " ".join(fp8.command) and "--list" in fp8.dry_command
    backward = next(s for s in session.extras() if s.name == "backward")  # out of the plan
    assert "--quick" in backward.command and "--dry-run" in backward.dry_command
    decode = stages[names.index("decode")]  # the fp8 cache rows too: never timed on a GPU yet
    assert "--fp8" in decode.command and "--fp8" in decode.dry_command
    # the host compiler's cubins before the long stages: cheap, and what every static reading
    # of the runs' SASS needs (bench/dump_cubins.py)
    cubins = stages[names.index("cubins")]
    assert names.index("racecheck") < names.index("cubins") < names.index("prefill")
    assert "bench.dump_cubins" in cubins.command and "--dry-run" in cubins.dry_command


@pytest.mark.compile
def test_the_dry_run_checks_every_stage_here(capsys):
    """What CI runs so that a GPU window is never spent on a typo: pytest collects a non-empty
    selection, the benchmarks accept their flags (--list), selfcheck compiles each engine."""
    assert session.dry_run(session.plan()) == 0
    out = capsys.readouterr().out
    assert "plan: 8 stages" in out and out.count(" ok ") == 8, out


def test_a_dry_run_reports_a_typo_in_a_stage():
    broken = session.Stage(
        "typo", 10, "a flag the benchmark does not know",
        (sys.executable, "-m", "bench.attention", "--no-such-flag"),
        (sys.executable, "-m", "bench.attention", "--no-such-flag", "--list"),
    )  # fmt: skip
    assert session.dry_run([broken]) == 1


def _git(repo, *args):
    subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True)


@pytest.fixture
def repo(tmp_path):
    _git(tmp_path, "init", "-q")
    _git(tmp_path, "config", "user.email", "t@t")
    _git(tmp_path, "config", "user.name", "t")
    (tmp_path / "a.py").write_text("x = 1\n")
    _git(tmp_path, "add", "a.py")
    _git(tmp_path, "commit", "-qm", "a")
    return tmp_path


def test_the_stamp_names_the_commit_and_the_files_that_changed(repo):
    stamp = repo / "stamp.json"
    record = session.write_stamp(repo, stamp)
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True)
    assert record["commit"] == head.stdout.strip() and list(record["files"]) == ["a.py"]
    assert session.check_stamp(repo, stamp) == (record["commit"], [])
    (repo / "a.py").write_text("x = 2\n")
    assert session.check_stamp(repo, stamp) == (record["commit"], ["a.py"])
    with pytest.raises(SystemExit, match="uncommitted"):
        session.write_stamp(repo, stamp)


def test_a_stage_past_its_budget_is_stopped_and_its_log_bundled(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(session, "check_stamp", lambda: ("c0ffee", []))
    monkeypatch.setattr(session, "gpu_facts", lambda: "no GPU")
    monkeypatch.setattr(session, "GRACE_S", 2)
    code = "import sys, time; print('started', flush=True); time.sleep(30)"
    slow = session.Stage("slow", 1, "sleeps past its budget", (sys.executable, "-c", code))
    quick = session.Stage("quick", 20, "exits 0", (sys.executable, "-c", "print('done')"))
    rc = session.run([slow, quick], tmp_path, allow_dirty=False)
    assert rc == 1  # one stage failed (cut at its budget)
    summary = (tmp_path / "summary.txt").read_text()
    assert "slow          rc=124" in summary and "quick         rc=0" in summary
    assert summary.startswith("commit c0ffee")
    with tarfile.open(tmp_path / "session.tgz") as tar:
        log = tar.extractfile("session/slow.log").read().decode()
    assert "started" in log


def test_a_tree_that_differs_from_the_stamp_is_refused(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(
        session, "check_stamp", lambda: ("c0ffee", ["kernelgen/calls/attention.py"])
    )
    stage = session.Stage("quick", 5, "exits 0", (sys.executable, "-c", "pass"))
    assert session.run([stage], tmp_path, allow_dirty=False) == 2
    assert "not the stamped commit" in capsys.readouterr().out
    assert not (tmp_path / "session.tgz").exists()


def test_profile_launch_builds_the_overridden_spec_and_refuses_bad_input(capsys):
    from bench import profile_launch

    path = ROOT / "specs" / "v2_wg_bf16_d128_m128_n128_s2.yaml"
    spec = profile_launch.build_spec(
        path, [profile_launch.parse_override(x) for x in ("causal=true", "q_in_registers=true")]
    )
    assert spec.uri == "fa_fwd_v2_wg_bf16_d128_m128_n128_w12_s2_qr_causal"
    assert profile_launch.main([str(path), "--set", "block_m=7"]) == 2
    assert "block_m=7 is not allowed" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        profile_launch.main([str(path), "--set", "causal"])
    assert "expected FIELD=VALUE" in capsys.readouterr().err


def test_the_extra_stages_run_only_when_named(capsys):
    assert not {s.name for s in session.extras()} & {s.name for s in session.plan()}
    assert session.main(["--dry-run", "profile"]) == 0
    out = capsys.readouterr().out
    assert "plan: 1 stages" in out and "profile" in out and "correctness" not in out


def test_ncu_pair_reads_labelled_specs_and_builds_them_without_a_gpu(capsys):
    from bench import ncu_pair, profile_launch

    path = ROOT / "specs" / "v2_wg_bf16_d128_m128_n128_s2_causal.yaml"
    label, parsed, overrides = profile_launch.parse_item(f"qr={path},q_in_registers=true")
    assert (label, parsed, overrides) == ("qr", path, ["q_in_registers=true"])
    assert ncu_pair.main([f"plain={path}", f"qr={path},q_in_registers=true", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "qr: fa_fwd_v2_wg_bf16_d128_m128_n128_w12_s2_qr_causal" in out
    assert ncu_pair.main([f"bad={path},block_m=7", "--dry-run"]) == 2
    assert "block_m=7 is not allowed" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        ncu_pair.main(["no-label-here", "--dry-run"])


def test_ncu_summary_reads_run_8s_source_page(capsys, tmp_path):
    """The committed ncu source page of run 8's plain causal kernel: its totals, the opcode
    that holds the most stall samples (the waits for wgmma) and the producer's retry wait."""
    from bench import ncu_summary

    path = ROOT / "bench/results/2026-11-27-h100-run8-ncu-plain-causal-source.csv.gz"
    kernel, instructions = ncu_summary.read_source(path)
    assert kernel == "fa_fwd_v2_wg_bf16_d128_m128_n128_w12_s2_causal" and len(instructions) == 2296
    assert sum(i.executed for i in instructions) == 124_313_335
    opcodes = ncu_summary.by_opcode(instructions)
    assert max(opcodes, key=lambda name: opcodes[name][1]) == "WARPGROUP"
    assert opcodes["HGMMA"][0] == 4_325_376  # 32 per two key tiles of every consumer warp
    assert ncu_summary.main([str(path), "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert "| 0x8e40 | SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [R6+URZ+0x28028], R3 | 589,721 |" in out
    bad = tmp_path / "x.csv"
    bad.write_text("a,b\n1,2\n3,4\n")
    assert ncu_summary.main([str(bad)]) == 2
    assert "not an ncu source page" in capsys.readouterr().err


@pytest.mark.compile
def test_dump_cubins_writes_what_the_host_compiler_made(tmp_path):
    """bench.dump_cubins compiles each item offline and writes its cubin and the NVRTC version
    (the cubin is the compiler's: the same bytes as kernelgen's own offline compile)."""
    from conftest import require_toolchain

    from bench import dump_cubins
    from kernelgen.kernels.compile import compile_offline, nvrtc_available, nvrtc_version
    from kernelgen.kernels.render import render
    from kernelgen.specs.forward import load_spec

    require_toolchain(nvrtc_available(), "NVRTC (cuda-bindings + nvidia-cuda-nvrtc wheels)")
    path = ROOT / "specs" / "v2_wg_bf16_d128_m128_n128_s2.yaml"
    assert dump_cubins.main(["--out", str(tmp_path), f"qr={path},q_in_registers=true"]) == 0
    spec = load_spec(path).model_copy(update={"q_in_registers": True})
    want = compile_offline(render(spec), spec.uri, "sm_90a", sass=False, report=False).cubin
    assert (tmp_path / "qr.cubin").read_bytes() == want
    versions = (tmp_path / "versions.txt").read_text().splitlines()
    assert versions == [f"nvrtc {nvrtc_version()}", f"qr {spec.uri} sm_90a"]
    assert dump_cubins.main(["--out", str(tmp_path), "qr=no/such.yaml"]) == 2
