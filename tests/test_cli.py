"""CPU tier (plus NVRTC for build): the kernelgen command, its exit codes and messages."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path

import pytest
from conftest import ALL_SPEC_PATHS, ROOT, SPEC_PATHS, cuda_device_count, require_toolchain
from typer.testing import CliRunner

from kernelgen.cli import app
from kernelgen.kernels.compile import cuobjdump_path, nvrtc_available
from kernelgen.kernels.render import render
from kernelgen.specs.forward import KernelSpec, load_spec

runner = CliRunner()
GOOD = "loop_order: v2\ndtype: float16\nhead_dim: 64\nblock_m: 64\nblock_n: 32\nnum_warps: 4\n"


def run(*args: str):
    return runner.invoke(app, list(args))


def test_schema_prints_json():
    result = run("schema")
    assert result.exit_code == 0
    assert "head_dim" in json.loads(result.stdout)["properties"]


def test_show_prints_the_source(tmp_path):
    spec_file = tmp_path / "s.yaml"
    spec_file.write_text(GOOD)
    result = run("show", str(spec_file))
    assert result.exit_code == 0
    assert result.stdout == render(load_spec(spec_file))


def test_bad_specs_print_one_line_each_and_exit_2(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        GOOD.replace("block_m: 64", "block_m: 40").replace("head_dim: 64", "head_dim: 7")
    )
    broken = tmp_path / "broken.yaml"
    broken.write_text("block_m: [\n")
    result = run("build", str(bad), str(broken), "-o", str(tmp_path / "out"))
    assert result.exit_code == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 3, lines
    assert all(line.startswith(str(tmp_path)) for line in lines)
    assert "Traceback" not in result.output
    assert not (tmp_path / "out").exists()  # nothing half-written


def test_unknown_arch_exits_2(tmp_path):
    spec_file = tmp_path / "s.yaml"
    spec_file.write_text(GOOD)
    result = run("check", str(spec_file), "--arch", "sm_75")
    assert result.exit_code == 2
    assert "--arch sm_75: unknown architecture" in result.stderr


def test_missing_file_exits_2(tmp_path):
    result = run("show", str(tmp_path / "nope.yaml"))
    assert result.exit_code == 2
    assert "cannot read spec file" in result.stderr


def test_build_writes_sources_and_manifest_then_check_passes(tmp_path):
    require_toolchain(nvrtc_available(), "NVRTC")
    spec_file = tmp_path / "s.yaml"
    spec_file.write_text(GOOD)
    out = tmp_path / "gen"
    result = run("build", str(spec_file), "-o", str(out), "--arch", "sm_80", "sm_90")
    assert result.exit_code == 0, result.output
    spec = load_spec(spec_file)
    assert (out / f"{spec.uri}.cu").read_text() == render(spec)
    manifest = json.loads((out / "manifest.json").read_text())
    entry = manifest["kernels"][spec.uri]
    assert set(entry["resources"]) == {"sm_80", "sm_90"}
    assert entry["resources"]["sm_90"]["spill_store_bytes"] == 0
    assert entry["spec"]["head_dim"] == 64
    assert run("build", str(spec_file), "-o", str(out), "--check").exit_code == 0
    # a stale source is detected
    (out / f"{spec.uri}.cu").write_text("// edited by hand\n")
    stale = run("build", str(spec_file), "-o", str(out), "--check")
    assert stale.exit_code == 1
    assert "out of date" in stale.stderr
    # an orphan is detected
    (out / f"{spec.uri}.cu").write_text(render(spec))
    (out / "orphan.cu").write_text("//\n")
    assert "no spec produces it" in run("build", str(spec_file), "-o", str(out), "--check").stderr
    # a manifest entry whose source is gone (its spec was removed) is detected, and dropped by
    # the next build
    (out / "orphan.cu").unlink()
    manifest["kernels"]["fa_fwd_removed"] = entry
    (out / "manifest.json").write_text(json.dumps(manifest))
    orphan = run("build", str(spec_file), "-o", str(out), "--check")
    assert orphan.exit_code == 1 and "entry for fa_fwd_removed has no source" in orphan.stderr
    assert run("build", str(spec_file), "-o", str(out), "--arch", "sm_90").exit_code == 0
    rebuilt = json.loads((out / "manifest.json").read_text())
    assert set(rebuilt["kernels"]) == {spec.uri}


def test_committed_generated_folder_is_up_to_date(tmp_path):
    """What CI checks: generated/ matches specs/ and the templates."""
    result = run("build", *map(str, ALL_SPEC_PATHS), "-o", str(ROOT / "generated"), "--check")
    assert result.exit_code == 0, result.output


def test_check_reports_resources(tmp_path):
    require_toolchain(nvrtc_available(), "NVRTC")
    spec_file = tmp_path / "s.yaml"
    spec_file.write_text(GOOD)
    result = run("check", str(spec_file), "--arch", "sm_90")
    assert result.exit_code == 0, result.output
    assert "sm_90" in result.stdout
    assert "232448" in result.stdout  # the arch's shared-memory limit beside the kernel's
    assert "blocks/SM (" in result.stdout  # resident blocks and what limits them
    if cuobjdump_path():  # local memory is shown even when there is none
        assert "LDL=0, STL=0" in result.stdout


def test_static_problems_name_each_way_a_kernel_fails_the_bar():
    """What `kernelgen check` exits 1 on (and the tuner drops): spills/stack, shared memory
    over the arch's limit, local memory or, for a tensor-core spec, no HMMA/LDSM in the SASS."""
    from kernelgen.kernels.build import static_problems
    from kernelgen.kernels.compile import Resources

    spec = KernelSpec(loop_order="v2", mma="mma_sync", dtype="float16", head_dim=64,
                      block_m=64, block_n=64, num_warps=4)  # fmt: skip
    clean = {"HMMA": 64, "LDSM": 40, "LDL": 0, "STL": 0}
    ok = Resources("sm_80", 180, 0, 0, 0, 0, clean)
    assert static_problems(spec, ok) == []
    assert static_problems(spec, dataclasses.replace(ok, sass_instructions={})) == []
    cases = [
        (dataclasses.replace(ok, spill_store_bytes=8, spill_load_bytes=4), "4 B spill loads"),
        (dataclasses.replace(ok, stack_bytes=24), "24 B stack"),
        (dataclasses.replace(ok, static_smem_bytes=200_000), "over the 166912-byte limit"),
        (dataclasses.replace(ok, sass_instructions={**clean, "LDL": 6}), "LDL 6, STL 0"),
        (dataclasses.replace(ok, sass_instructions={**clean, "HMMA": 0}), "without HMMA"),
    ]
    for res, words in cases:
        (why,) = static_problems(spec, res)
        assert words in why and "sm_80" in why, why


def test_console_script_exits_2_without_traceback(tmp_path):
    import subprocess

    # The script pip installed next to this interpreter (the venv need not be on PATH).
    script = Path(sys.executable).parent / "kernelgen"
    assert script.exists(), f"console script missing: {script}"
    bad = tmp_path / "bad.yaml"
    bad.write_text("dtype: float64\n")
    done = subprocess.run([str(script), "build", str(bad)], capture_output=True, text=True)
    assert done.returncode == 2
    assert "Traceback" not in done.stderr
    assert "dtype='float64' is not allowed" in done.stderr


def test_bad_template_dir_exits_2_in_one_line(tmp_path):
    import subprocess

    script = Path(sys.executable).parent / "kernelgen"
    spec_file = tmp_path / "ok.yaml"
    spec_file.write_text(GOOD)
    env = {**os.environ, "KERNELGEN_TEMPLATE_DIR": str(tmp_path / "nowhere")}
    for args in (["show", str(spec_file)], ["build", str(spec_file), "--check"]):
        done = subprocess.run([str(script), *args], capture_output=True, text=True, env=env)
        assert done.returncode == 2, done.stderr
        assert "Traceback" not in done.stderr
        assert done.stderr.strip().count("\n") == 0
        assert "KERNELGEN_TEMPLATE_DIR=" in done.stderr and "missing fa_fwd_v1.cu.j2" in done.stderr


def test_every_subpackage_ships_in_the_wheel():
    """pyproject lists packages explicitly: a new subpackage must be listed or a non-editable
    install cannot import it."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    listed = set(
        tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    )
    found = {
        ".".join(p.parent.relative_to(ROOT).parts)
        for p in (ROOT / "kernelgen").rglob("__init__.py")
    }
    assert found <= listed, found - listed


def test_selfcheck_without_a_gpu_says_so_in_one_line(capsys):
    from kernelgen.selfcheck import main

    if cuda_device_count() > 0:
        pytest.skip("a CUDA device is visible (the GPU tier runs the selfcheck)")
    assert main(["float16"]) == 2
    out = capsys.readouterr().out.strip()
    assert out.startswith("selfcheck: ") and "\n" not in out
    assert main(["int8"]) == 2
    assert "float16 or bfloat16" in capsys.readouterr().out


@pytest.mark.parametrize("command", ["build", "check", "show"])
def test_spec_not_utf8_exits_2_in_one_line(tmp_path, command):
    spec_file = tmp_path / "s.yaml"
    spec_file.write_bytes(b"# \xe9t\xe9\n" + GOOD.encode())
    result = run(command, str(spec_file))
    assert result.exit_code == 2
    assert result.stderr.strip().splitlines() == [
        f"{spec_file}: not UTF-8 text: byte 0xe9 at line 1; save the file as UTF-8"
    ]


def test_alias_bomb_and_duplicate_keys_exit_2_in_one_line(tmp_path):
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text("a: &a [x, x]\nb: &b [*a, *a]\nc: [*b, *b]\n")
    dup = tmp_path / "dup.yaml"
    dup.write_text(GOOD + "head_dim: 128\n")
    flag = tmp_path / "flag.yaml"
    flag.write_text(GOOD.replace("head_dim: 64", "head_dim: true"))
    result = run("check", str(bomb), str(dup), str(flag))
    assert result.exit_code == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 3, lines
    assert "anchors (&name) are not allowed" in lines[0]
    assert "duplicate key 'head_dim'" in lines[1]
    assert "head_dim=True is not allowed; use an integer" in lines[2]


@pytest.mark.parametrize("where", ["file", "below_file"])
def test_build_into_an_existing_file_exits_2_before_compiling(tmp_path, monkeypatch, where):
    import kernelgen.kernels.build

    def no_compile(*_args, **_kwargs):
        raise AssertionError("compiled before checking the output folder")

    monkeypatch.setattr(kernelgen.kernels.build, "build_kernels", no_compile)
    spec_file = tmp_path / "s.yaml"
    spec_file.write_text(GOOD)
    taken = tmp_path / "taken"
    taken.write_text("not a folder\n")
    out = taken if where == "file" else taken / "sub"
    for args in (["-o", str(out)], ["-o", str(out), "--check"]):
        result = run("build", str(spec_file), *args)
        assert result.exit_code == 2, result.output
        assert result.stderr.strip().splitlines() == [
            f"-o {out}: {taken} exists and is not a folder"
        ]
    assert taken.read_text() == "not a folder\n"


LONG = "loop_order: v2\ndtype: bfloat16\nhead_dim: 128\nblock_m: 64\nblock_n: 64\nnum_warps: 4\n"
LONG += "mma: mma_sync\nstages: 3\nsmem_layout: swizzled\ncausal: true\npack_gqa: true\n"
LONG += "split_kv: true\narchs: [sm_80, sm_90]\n"


def fake_build(monkeypatch, spill: int = 0) -> None:
    """`build_kernels` without NVRTC: every kernel gets 255 registers and ``spill`` bytes."""
    import kernelgen.kernels.build
    from kernelgen.kernels.build import BuiltKernel
    from kernelgen.kernels.compile import Resources

    def build_kernels(specs, archs=None, on_compiled=None):
        sass = {"HMMA": 64, "LDSM": 40, "LDL": 0, "STL": 0}
        return [
            BuiltKernel(
                spec,
                render(spec),
                [Resources(a, 255, spill, spill, 0, 0, sass) for a in archs or spec.archs],
            )
            for spec in specs
        ]

    monkeypatch.setattr(kernelgen.kernels.build, "build_kernels", build_kernels)


def test_piped_output_is_not_wrapped_at_80_columns(tmp_path, monkeypatch):
    """Through a pipe (CliRunner's stdout is not a terminal) the build table keeps each kernel
    name and its numbers on one line, however long, even where COLUMNS says 40."""
    fake_build(monkeypatch)
    monkeypatch.setenv("COLUMNS", "40")
    spec_file = tmp_path / "s.yaml"
    spec_file.write_text(LONG)
    uri = load_spec(spec_file).uri
    assert len(uri) > 40
    result = run("build", str(spec_file), "-o", str(tmp_path / "out"))
    assert result.exit_code == 0, result.output
    rows = [line for line in result.stdout.splitlines() if uri in line]
    assert len(rows) == 1 and "255/255" in rows[0], result.stdout
    title = [line for line in result.stdout.splitlines() if "kernelgen build" in line]
    assert len(title) == 1 and "local = spill + stack bytes)" in title[0], result.stdout


def test_version_prints_the_version():
    from kernelgen import __version__

    result = run("--version")
    assert result.exit_code == 0
    assert result.stdout == f"kernelgen {__version__}\n"


def test_build_warns_about_each_spilling_kernel_that_check_fails(tmp_path, monkeypatch):
    fake_build(monkeypatch, spill=8)
    spec_file = tmp_path / "s.yaml"
    spec_file.write_text(LONG)
    uri = load_spec(spec_file).uri
    result = run("build", str(spec_file), "-o", str(tmp_path / "out"))
    assert result.exit_code == 0, result.output
    assert (tmp_path / "out" / f"{uri}.cu").exists()
    warnings = result.stderr.strip().splitlines()
    assert len(warnings) == 2, warnings  # one per arch
    assert all(w.startswith(f"warning: {uri}: ptxas on sm_") for w in warnings)
    assert all(w.endswith("(kernelgen check exits 1 on it)") for w in warnings)
    checked = run("check", str(spec_file))
    assert checked.exit_code == 1
    assert len(checked.stderr.strip().splitlines()) == 2
    help_text = " ".join(run("build", "--help").stdout.replace("│", " ").split())
    assert "(it exits 1 on the same kernels)" in help_text


@pytest.mark.compile
def test_build_reports_each_compile_for_the_progress_bar_and_logs_stay_clean(tmp_path):
    """build_kernels tells its listener of every (spec, arch) compile; off a terminal the CLI
    shows no progress bar, so piped output holds only the table and the summary."""
    from kernelgen.kernels.build import build_kernels

    require_toolchain(nvrtc_available(), "NVRTC (cuda-bindings + nvidia-cuda-nvrtc wheels)")
    spec = load_spec(SPEC_PATHS[0])
    heard: list[str] = []
    build_kernels([spec], ["sm_80", "sm_90"], heard.append)
    assert heard == [f"{spec.uri} sm_80", f"{spec.uri} sm_90"]
    result = CliRunner().invoke(app, ["build", str(SPEC_PATHS[0]), "-o", str(tmp_path / "g")])
    assert result.exit_code == 0, result.output
    assert "compiling" not in result.output and "━" not in result.output


def test_a_malformed_expression_is_one_line_and_exit_2(tmp_path):
    spec_file = tmp_path / "expr.yaml"
    spec_file.write_text(GOOD + "mask_mod: \"__import__('os').system('true')\"\n")
    result = run("build", str(spec_file), "-o", str(tmp_path / "out"))
    assert result.exit_code == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "mask_mod" in lines[0] and "__import__" in lines[0], lines
    assert "Traceback" not in result.output
    assert not (tmp_path / "out").exists()
