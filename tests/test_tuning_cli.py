"""CPU tier (plus NVRTC for one dry run): `kernelgen tune` and `kernelgen cache`."""

from __future__ import annotations

import dataclasses
import json

import pytest
import typer
from conftest import require_toolchain
from test_tuning_fakes import DEVICE, SOFTWARE, fake_compile, fake_tuner, problem
from typer.testing import CliRunner

from kernelgen.cli import tune as cli_tune
from kernelgen.kernels.compile import nvrtc_available
from kernelgen.tuning import TuningDB, clear_memo, make_key, select_spec
from kernelgen.tuning.db import wrap

runner = CliRunner()
app = typer.Typer()


@app.callback()
def _root() -> None:
    """Stands in for the kernelgen command."""


cli_tune.register(app)


@pytest.fixture(autouse=True)
def isolated(tuning_sandbox):
    """Every test gets its own tuning cache and memo (conftest)."""


def run(*args: str):
    return runner.invoke(app, list(args))


def test_dry_run_with_a_fake_compile(monkeypatch):
    from kernelgen.tuning import candidates

    # on a 9.0 device the wgmma (sm_90a) specs rank first in the static model
    spilling = "fa_fwd_v2_wg_f16_d64_m128_n128_w12_s3_ovl_causal"  # overlap: 3 stages
    monkeypatch.setattr(candidates, "offline_resources", fake_compile(frozenset({spilling})))
    monkeypatch.setenv("COLUMNS", "200")
    result = run(
        "tune", "--shape", "2,16,16,2048,2048,64", "--dtype", "fp16", "--causal", "--dry-run"
    )
    assert result.exit_code == 0, result.output
    assert "fa_fwd_v2_wg_f16_d64_m128_n128_w12_s2_causal" in result.stdout
    assert f"drop [resources] {spilling}: ptxas" in result.stdout
    assert "dry run: nothing timed" in result.stdout


def test_dry_run_of_a_decode_shape_lists_split_counts(monkeypatch):
    from kernelgen.tuning import candidates

    monkeypatch.setattr(candidates, "offline_resources", fake_compile())
    monkeypatch.setenv("COLUMNS", "200")
    result = run("tune", "--shape", "1,32,8,1,32768,128", "--dtype", "bf16", "--dry-run")
    assert result.exit_code == 0, result.output
    rows = [
        line.split()
        for line in result.stdout.splitlines()
        if line.strip().startswith("fa_fwd_v2_tc_bf16_d128_m16_n64_w1_s2_swz_gqa_split ")
    ]
    splits = sorted(int(r[1]) for r in rows)
    assert len(splits) >= 3 and splits[0] > 1  # one row per split count, all filling the GPU
    assert "drop [occupancy] fa_fwd_v2_tc_bf16_d128_m16_n64_w1_s2_swz_gqa: grid has 8 blocks" in (
        result.stdout
    )


@pytest.mark.compile
def test_dry_run_compiles_offline_without_a_gpu():
    require_toolchain(nvrtc_available(), "NVRTC (cuda-bindings)")
    result = run(
        "tune", "--shape", "1,4,4,256,256,32", "--dtype", "fp32", "--dry-run", "--arch", "sm_80"
    )
    assert result.exit_code == 0, result.output
    assert "fa_fwd_v2_f32_d32" in result.stdout and "sm_80" in result.stdout
    assert "drop [occupancy]" in result.stdout


@pytest.mark.parametrize(
    "args",
    [
        ("tune", "--shape", "1,2,3", "--dry-run"),
        ("tune", "--shape", "1,8,8,64,64,64", "--dtype", "int8", "--dry-run"),
        ("tune", "--shape", "1,8,8,64,64,64", "--dry-run", "--arch", "hopper"),
        ("tune", "--shape", "1,8,8,64,64,64"),  # no GPU (or no CuPy) here
        ("cache", "show", "no-such-key"),
        ("tune", "--shape", "1,8,8,64,64,64", "--dry-run", "--sms", "0"),
        ("tune", "--shape", "1,8,8,64,64,300", "--dry-run"),  # no kernel has that head dim
        ("tune", "--shape", "1,8,8,64,64,60", "--dry-run"),
        ("cache", "import", "/no/such/bundle.json"),  # read before the GPU is looked for
    ],
)
def test_problems_are_one_line_and_exit_2(args, monkeypatch):
    if args[-1] in ("1,8,8,64,64,64", "/no/such/bundle.json"):
        from kernelgen.errors import ToolchainMissingError

        def no_gpu():
            raise ToolchainMissingError("CuPy is not installed; install kernelgen[cuda]")

        monkeypatch.setattr(cli_tune, "current_environment", no_gpu)
    result = run(*args)
    assert result.exit_code == 2, result.output
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "Traceback" not in result.output
    if args[0] == "cache" and args[1] == "import":
        assert "cannot read /no/such/bundle.json" in result.stderr
    if "--sms" in args:
        assert "--sms 0" in result.stderr
    if args[2].endswith(("300", ",60")):
        assert result.stderr.startswith(f"head_dim={args[2].split(',')[-1]} is not allowed")
        assert result.stdout == ""  # no empty table, no drop lines


def test_cache_round_trip(tmp_path, monkeypatch):
    problems = [problem(), problem(dtype="float16", causal=True)]
    specs = [select_spec(p, DEVICE, software=SOFTWARE, tuner=fake_tuner()) for p in problems]
    keys = [make_key(p, DEVICE, SOFTWARE) for p in problems]

    listed = run("cache", "list")
    assert listed.exit_code == 0
    assert all(k.id[:20] in listed.stdout for k in keys)

    shown = run("cache", "show", keys[0].id[:24])
    assert shown.exit_code == 0, shown.output
    assert json.loads(shown.stdout)["key_id"] == keys[0].id

    bundle = tmp_path / "tuning.json"
    assert run("cache", "export", str(bundle)).exit_code == 0
    assert run("cache", "clear").exit_code == 0
    assert TuningDB().records() == []

    monkeypatch.setattr(cli_tune, "current_environment", lambda: (DEVICE, SOFTWARE))
    imported = run("cache", "import", str(bundle))
    assert imported.exit_code == 0, imported.output
    assert "imported 2 records" in imported.stdout
    clear_memo()
    for p, spec in zip(problems, specs, strict=True):
        assert select_spec(p, DEVICE, software=SOFTWARE, mode="offline") == spec


def test_import_rejects_another_device_or_software(tmp_path, monkeypatch):
    select_spec(problem(), DEVICE, software=SOFTWARE, tuner=fake_tuner())
    bundle = tmp_path / "tuning.json"
    assert run("cache", "export", str(bundle)).exit_code == 0
    run("cache", "clear")
    newer = dataclasses.replace(SOFTWARE, kernelgen="9.9.9")
    monkeypatch.setattr(cli_tune, "current_environment", lambda: (DEVICE, newer))
    result = run("cache", "import", str(bundle))
    assert result.exit_code == 2
    assert "rejected" in result.stderr and "Fake GPU" in result.stderr
    assert "kernelgen 0.1.0" in result.stderr
    assert TuningDB().records() == []


def test_import_of_a_damaged_bundle_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setattr(cli_tune, "current_environment", lambda: (DEVICE, SOFTWARE))
    bundle = tmp_path / "bad.json"
    bundle.write_text('{"format": 1, "checksum": "x", "payload": {}}')
    result = run("cache", "import", str(bundle))
    assert result.exit_code == 2 and "not a kernelgen tuning export" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_import_of_a_bundle_with_a_bad_record_writes_nothing(tmp_path, monkeypatch):
    """Every record is checked before the first is stored: no half-imported bundle."""
    for p in (problem(), problem(dtype="float16")):
        select_spec(p, DEVICE, software=SOFTWARE, tuner=fake_tuner())
    bundle = tmp_path / "tuning.json"
    assert run("cache", "export", str(bundle)).exit_code == 0
    run("cache", "clear")
    document = json.loads(bundle.read_text())
    document["payload"]["records"][1].pop("winner")
    bundle.write_text(json.dumps(wrap(document["payload"])))
    monkeypatch.setattr(cli_tune, "current_environment", lambda: (DEVICE, SOFTWARE))
    result = run("cache", "import", str(bundle))
    assert result.exit_code == 2
    assert "record 1 is unusable" in result.stderr, result.stderr
    assert TuningDB().records() == []


class _CUDARuntimeError(RuntimeError):
    """Stands in for cupy_backends' CUDARuntimeError."""


def _driverless_cupy():
    """A CuPy as installed on a machine without a driver: every runtime call raises, as does
    ``cuda.Device()`` (cupy-cuda13x 14.2: cudaErrorInsufficientDriver)."""
    import types

    def fail(*_args, **_kwargs):
        raise _CUDARuntimeError("cudaErrorInsufficientDriver: CUDA driver version is insufficient")

    runtime = types.SimpleNamespace(
        CUDARuntimeError=_CUDARuntimeError,
        getDeviceCount=fail,
        getDevice=fail,
        getDeviceProperties=fail,
    )
    cupy = types.ModuleType("cupy")
    cupy.cuda = types.SimpleNamespace(runtime=runtime, Device=fail)
    return cupy


def test_cupy_without_a_driver_dry_runs_and_tune_and_import_say_so(tmp_path, monkeypatch):
    import sys

    from kernelgen.tuning import candidates

    monkeypatch.setitem(sys.modules, "cupy", _driverless_cupy())
    monkeypatch.setattr(candidates, "offline_resources", fake_compile())
    result = run("tune", "--shape", "1,8,8,512,512,64", "--dtype", "fp16", "--dry-run")
    assert result.exit_code == 0, result.output
    assert "(assumed) NVIDIA H100" in result.stdout and "sm_90" in result.stdout
    result = run("tune", "--shape", "1,8,8,512,512,64", "--dtype", "fp16")
    assert result.exit_code == 2, result.output
    assert result.stderr.strip().splitlines() == [
        "no usable CUDA device: cudaErrorInsufficientDriver: CUDA driver version is insufficient"
    ]
    bundle = tmp_path / "empty.json"
    assert run("cache", "export", str(bundle)).exit_code == 0
    result = run("cache", "import", str(bundle))
    assert result.exit_code == 2, result.output
    assert len(result.stderr.strip().splitlines()) == 1
    assert "no usable CUDA device" in result.stderr


def test_real_cupy_without_a_driver_dry_runs(tmp_path):
    """The same with the real CuPy, where it is installed on a machine without a GPU driver."""
    import os
    import subprocess
    import sys

    probe = (
        "import cupy\n"
        "try:\n    n = cupy.cuda.runtime.getDeviceCount()\n"
        "except cupy.cuda.runtime.CUDARuntimeError:\n    n = 0\n"
        "print(n)\n"
    )
    found = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    if found.returncode != 0:
        pytest.skip("CuPy is not importable here")
    if found.stdout.strip() != "0":
        pytest.skip("a CUDA device is visible here")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "KERNELGEN_CACHE_DIR": str(tmp_path / "cache")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    base = [sys.executable, "-m", "kernelgen.cli", "tune", "--shape", "1,4,4,64,64,32"]
    dry = subprocess.run([*base, "--dry-run"], capture_output=True, text=True, env=env)
    assert "Traceback" not in dry.stderr and "CUDARuntimeError" not in dry.stderr, dry.stderr
    assert dry.returncode == 0, dry.stderr
    assert "(assumed) NVIDIA H100" in dry.stdout
    real = subprocess.run(base, capture_output=True, text=True, env=env)
    assert real.returncode == 2, real.stderr
    assert len(real.stderr.strip().splitlines()) == 1
    assert "no usable CUDA device" in real.stderr
