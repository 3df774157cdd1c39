"""CPU tier: what kernelgen reads from and writes to disk, against hostile files and shared
folders (docs/security.md): the emulator's build cache, failed-compile sources, tuning records
and bundles, manifests, nested input and file modes."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import re
import stat
from pathlib import Path
from typing import Any

import pytest
import yaml
from test_cli import GOOD, fake_build
from test_tuning_fakes import SOFTWARE, fake_tuner, problem
from typer.testing import CliRunner

from kernelgen.cli import app
from kernelgen.cli import tune as cli_tune
from kernelgen.emulator import kernel as emulator_kernel
from kernelgen.errors import SpecError, UnsafeFolderError
from kernelgen.fileio import atomic_write_text, private_dir
from kernelgen.kernels.build import BuiltKernel, write_generated
from kernelgen.kernels.compile import save_failed_source
from kernelgen.kernels.render import render
from kernelgen.specs.forward import load_spec, spec_from_dict
from kernelgen.tuning import (
    DeviceInfo,
    TuningDB,
    TuningMissError,
    TuningRecord,
    make_key,
    select_launch,
)
from kernelgen.tuning.db import wrap
from kernelgen.tuning.key import key_problems

runner = CliRunner()
A100 = DeviceInfo("Fake A100 80GB", "8.0", 108)  # mma_sync winners: every spec field can vary
IS_ROOT = hasattr(os, "geteuid") and os.geteuid() == 0


@pytest.fixture(autouse=True)
def isolated(tuning_sandbox):
    """Every test gets its own tuning cache and memo (conftest)."""


def mode_of(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


# --- the emulator's build cache ------------------------------------------------------------


def test_emulator_cache_is_a_private_folder_under_the_cache_home(tmp_path, monkeypatch):
    monkeypatch.delenv("KG_EMULATOR_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    folder = emulator_kernel.cache_dir()
    assert folder == tmp_path / "xdg" / "kernelgen" / "emulator"
    assert mode_of(folder) == 0o700
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert emulator_kernel.cache_dir() == tmp_path / "home" / ".cache" / "kernelgen" / "emulator"


def test_emulator_cache_override_is_created_private(tmp_path, monkeypatch):
    monkeypatch.setenv("KG_EMULATOR_CACHE", str(tmp_path / "mine" / "builds"))
    folder = emulator_kernel.cache_dir()
    assert folder == tmp_path / "mine" / "builds" and mode_of(folder) == 0o700


def _planted(tmp_path: Path, mode: int) -> Path:
    """A cache folder as another user could leave it, with a library in it."""
    folder = tmp_path / "kg_emulator_cache"
    folder.mkdir()
    (folder / "kernel-0123.so").write_bytes(b"\x7fELF planted")
    folder.chmod(mode)
    return folder


@pytest.mark.parametrize("mode", [0o777, 0o1777, 0o775, 0o757])
def test_emulator_refuses_a_cache_others_may_write_to(tmp_path, monkeypatch, mode):
    """Nothing is compiled into, or loaded from, a folder someone else can put a library in."""
    folder = _planted(tmp_path, mode)
    monkeypatch.setenv("KG_EMULATOR_CACHE", str(folder))
    monkeypatch.setattr(emulator_kernel, "_compiler", lambda: "/bin/false")
    monkeypatch.setattr(emulator_kernel, "_compiler_version", lambda path: "fake")
    monkeypatch.setattr(emulator_kernel.ctypes, "CDLL", pytest.fail)
    source = 'extern "C" __global__ void kernel(float* x) { x[0] = 1.0f; }'
    with pytest.raises(UnsafeFolderError) as info:
        emulator_kernel.build_kernel(source, "kernel", [("float*", "x")])
    assert str(folder) in str(info.value) and f"mode {mode:04o}" in str(info.value)
    assert sorted(p.name for p in folder.iterdir()) == ["kernel-0123.so"]


@pytest.mark.skipif(not IS_ROOT, reason="only root can give a folder to another user")
def test_emulator_refuses_a_cache_another_user_owns(tmp_path, monkeypatch):
    folder = _planted(tmp_path, 0o755)
    os.chown(folder, 4242, 4242)
    monkeypatch.setenv("KG_EMULATOR_CACHE", str(folder))
    with pytest.raises(UnsafeFolderError, match="belongs to uid 4242"):
        emulator_kernel.cache_dir()


def test_a_private_folder_inside_one_anyone_may_rename_in_is_refused(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)  # no sticky bit: anyone may swap ours for theirs
    with pytest.raises(UnsafeFolderError, match="lets anyone rename"):
        private_dir(shared / "mine")
    shared.chmod(0o1777)  # as /tmp: entries are safe from others
    assert mode_of(private_dir(shared / "mine")) == 0o700


def test_a_link_of_the_users_own_to_a_private_folder_is_used(tmp_path):
    target = private_dir(tmp_path / "real")
    (tmp_path / "link").symlink_to(target)
    assert private_dir(tmp_path / "link") == tmp_path / "link"
    (tmp_path / "file").write_text("")
    with pytest.raises(UnsafeFolderError, match="not a directory"):
        private_dir(tmp_path / "file")


# --- failed-compile sources ----------------------------------------------------------------


def test_a_failed_source_never_follows_a_planted_link(tmp_path, monkeypatch):
    monkeypatch.setenv("KERNELGEN_FAILED_DIR", str(tmp_path))
    folder = tmp_path / "kernelgen"
    folder.mkdir(mode=0o700)
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    for name in ("fa_fwd.failed.cu", "fa_fwd-00000000.failed.cu"):
        (folder / name).symlink_to(victim)
    saved = Path(save_failed_source("fa_fwd", "// the source\n"))
    assert victim.read_text() == "precious\n"
    assert saved.parent == folder and not saved.is_symlink()
    assert saved.read_text() == "// the source\n" and mode_of(saved) == 0o600
    again = Path(save_failed_source("fa_fwd", "// another\n"))
    assert again != saved and saved.read_text() == "// the source\n"


def test_failed_sources_go_to_a_private_folder_and_not_into_a_shared_one(tmp_path, monkeypatch):
    monkeypatch.delenv("KERNELGEN_FAILED_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    saved = Path(save_failed_source("k/../../x", "//\n"))
    assert saved.parent == tmp_path / "xdg" / "kernelgen" / "failed"
    assert mode_of(saved.parent) == 0o700 and saved.name.startswith("k_.._.._x-")
    shared = tmp_path / "tmp" / "kernelgen"
    shared.mkdir(parents=True)
    shared.chmod(0o777)
    monkeypatch.setenv("KERNELGEN_FAILED_DIR", str(tmp_path / "tmp"))
    assert save_failed_source("k", "//\n") is None
    assert list(shared.iterdir()) == []


# --- tuning keys: every field checked, every path inside the cache ---------------------------


def _record(device: DeviceInfo = A100, **overrides: object) -> TuningRecord:
    p = problem(dtype="float16", head_dim=64, causal=True, **overrides)
    return fake_tuner()(p, make_key(p, device, SOFTWARE))


def _bundle(tmp_path: Path, payloads: list[dict]) -> Path:
    bundle = tmp_path / "bundle.json"
    bundle.write_text(json.dumps(wrap({"kind": "kernelgen-tuning-export", "records": payloads})))
    return bundle


@pytest.mark.parametrize(
    "field, value",
    [
        ("variants", ["../../../escaped"]),
        ("variants", ["softcap", "softcap"]),
        ("head_dim", "64/../../../../escaped"),
        ("head_dim", True),
        ("dtype", "../escaped"),
        ("seqlen_q", 1000),
        ("page_size", 8),
    ],
)
def test_import_refuses_a_bundle_with_a_bad_key_field_and_writes_nothing(
    tmp_path, monkeypatch, field, value
):
    """The bundle carries the victim's public device/software values and a valid checksum."""
    payload = _record().payload()
    payload["key"]["problem"][field] = value
    bundle = _bundle(tmp_path, [payload])
    monkeypatch.setattr(cli_tune, "current_environment", lambda: (A100, SOFTWARE))
    # deep enough that a file escaping the cache would still land under tmp_path
    monkeypatch.setenv("KERNELGEN_CACHE_DIR", str(tmp_path / "a" / "b" / "c" / "d" / "cache"))
    before = sorted(tmp_path.rglob("*"))
    result = runner.invoke(app, ["cache", "import", str(bundle)])
    assert result.exit_code == 2, result.output
    assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.output
    assert f"problem.{field}=" in result.stderr
    assert sorted(tmp_path.rglob("*")) == before  # no file written, no folder made


@pytest.mark.parametrize(
    "part, field, value, message",
    [
        ("problem", "dtype", "float8", "problem.dtype='float8' is not one of"),
        ("problem", "head_dim", "64", "problem.head_dim='64' is not an integer"),
        ("problem", "head_dim", 4096, "problem.head_dim=4096 is not a multiple of 8"),
        ("problem", "causal", 1, "problem.causal=1 is not bool"),
        ("problem", "variants", ["nope"], "problem.variants=['nope'] are not distinct names"),
        ("problem", "variants", "softcap", "problem.variants='softcap' is not list"),
        ("problem", "extra", 1, "problem.extra is not a field"),
        ("device", "compute_capability", "../9.0", "device.compute_capability='../9.0'"),
        ("device", "sm_count", 0, "device.sm_count=0 is not at least 1"),
        ("device", "name", ["x"], "device.name=['x'] is not a string"),
        ("software", "kernelgen", 5, "software.kernelgen=5 is not a string"),
        ("software", "cupy", "x" * 500, "software.cupy="),
    ],
)
def test_key_problems_name_the_field_the_value_and_what_is_allowed(part, field, value, message):
    data = _record().key.as_dict()
    data[part][field] = value
    problems = key_problems(data)
    assert len(problems) == 1 and problems[0].startswith(message), problems
    assert key_problems(_record().key.as_dict()) == []


def test_a_stored_record_with_a_bad_key_is_a_miss(caplog):
    record = _record()
    db = TuningDB()
    db.save(record)
    payload = record.payload()
    payload["key"]["problem"]["head_dim"] = "64"
    db.path(record.key).write_text(json.dumps(wrap(payload)))
    with caplog.at_level(logging.WARNING, logger="kernelgen.tuning"):
        assert db.load(record.key) is None
    assert "problem.head_dim='64'" in caplog.text


def test_a_record_path_never_leaves_the_tuning_folder(tmp_path):
    """Even a key built by hand (no file read) cannot name a file outside the folder."""
    record = _record()
    bad_problem = dataclasses.replace(record.key.problem, variants=("../../../escaped",))
    escaping = dataclasses.replace(record.key, problem=bad_problem)
    db = TuningDB()
    for key in (escaping, "../escaped", "a/b", ".hidden-0123456789ab"):
        with pytest.raises(ValueError, match="does not name a file in"):
            db.path(key)
    with pytest.raises(ValueError, match="does not name a file in"):
        db.write(dataclasses.replace(record, key=escaping))
    assert not [p for p in tmp_path.rglob("*") if "escaped" in p.name]


# --- a record's winner must fit its key ------------------------------------------------------


@pytest.mark.parametrize(
    "change, splits, why",
    [
        ({"dtype": "bfloat16", "head_dim": 32, "causal": False, "smem_layout": "padded",
          "smem_pad": None}, None,
         "dtype='bfloat16', the key has 'float16'"),
        ({"causal": False}, None, "causal=False, the key has True"),
        ({"softcap": True}, None, "variants ['softcap'], the key has []"),
        ({"paged_kv": True}, None, "paged_kv=True, the key has False"),
        ({"additive_mask": True}, None, "additive_mask=True, the key has False"),
        ({"archs": ["sm_90"]}, None, "archs ['sm_90'], the key's device is sm_80"),
        ({"mma": "wgmma", "archs": ["sm_90a"], "num_warps": 12, "block_m": 128, "block_n": 128},
         None, "archs ['sm_90a'], the key's device is sm_80"),
        ({}, 4, "4 splits for a kernel without split_kv"),
        ({"block_m": 40}, None, "not a valid spec"),
    ],
)  # fmt: skip
def test_a_winner_that_does_not_fit_its_key_is_a_miss_with_one_warning(caplog, change, splits, why):
    record = _record()
    db = TuningDB()
    db.save(record)
    payload = record.payload()
    winner = {**payload["winner"], **change}
    payload["winner"] = {name: value for name, value in winner.items() if value is not None}
    payload["winner_launch"] = {"num_splits": splits}
    db.path(record.key).write_text(json.dumps(wrap(payload)))
    p = problem(dtype="float16", head_dim=64, causal=True)
    with caplog.at_level(logging.WARNING, logger="kernelgen.tuning"):
        with pytest.raises(TuningMissError):
            select_launch(p, A100, software=SOFTWARE, mode="offline", db=db)
        with pytest.raises(TuningMissError):
            select_launch(p, A100, software=SOFTWARE, mode="offline", db=db)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and why in warnings[0], warnings
    # on import, the same record is refused with the same reason
    bundle = _bundle(db.root, [payload])
    with pytest.raises(ValueError, match="record 0 is unusable"):
        TuningDB.read_bundle(bundle)


def test_a_winner_that_fits_its_key_is_used():
    record = _record()
    db = TuningDB()
    db.save(record)
    p = problem(dtype="float16", head_dim=64, causal=True)
    launch = select_launch(p, A100, software=SOFTWARE, mode="offline", db=db)
    assert launch.spec == spec_from_dict(record.winner)


# --- nested input: a typed error or a miss, never a RecursionError ----------------------------


@pytest.mark.parametrize(
    "text",
    [
        "head_dim: " + "[" * 3000 + "]" * 3000 + "\n",  # 6 KB of nested lists
        "".join(f"{'  ' * i}k{i}:\n" for i in range(500)) + "  " * 500 + "1\n",  # 500 levels
        "head_dim: " + "{a: " * 1000 + "1" + "}" * 1000 + "\n",
    ],
    ids=["lists", "block-mapping", "flow-mapping"],
)
@pytest.mark.parametrize("command", ["show", "build"])
def test_a_deeply_nested_spec_is_one_line_and_exit_2(tmp_path, text, command):
    spec_file = tmp_path / "deep.yaml"
    spec_file.write_text(text)
    extra = ["-o", str(tmp_path / "out")] if command == "build" else []
    result = runner.invoke(app, [command, str(spec_file), *extra])
    assert result.exit_code == 2, result.output
    expected = re.escape(str(spec_file)) + (
        r": invalid YAML: line \d+: values nested more than 32 levels deep are not allowed"
    )
    (line,) = result.stderr.strip().splitlines()
    assert re.fullmatch(expected, line), line
    with pytest.raises(SpecError, match="nested more than 32 levels"):
        load_spec(spec_file)


def test_spec_from_dict_of_a_deeply_nested_value_is_a_spec_error():
    deep: list = []
    for _ in range(100_000):
        deep = [deep]
    with pytest.raises(SpecError, match="nested more than"):
        spec_from_dict({**yaml.safe_load(GOOD), "head_dim": deep})
    with pytest.raises(SpecError, match="nested more than"):
        spec_from_dict({**yaml.safe_load(GOOD), "unknown": deep})


def deep_document(payload: dict, path: tuple[str | int, ...], depth: int) -> str:
    """A format-1 document whose payload holds, at ``path``, objects nested ``depth`` deep, with
    the checksum that payload has: the JSON is spliced as text (json.dumps refuses to write it),
    so the reader gets past the checksum to whatever comes next."""
    marker = "KG-NESTED-VALUE"
    node: Any = payload
    for name in path[:-1]:
        node = node[name]
    node[path[-1]] = marker

    def nested(separator: str) -> str:
        return f'{{"a"{separator}' * depth + "{}" + "}" * depth

    canonical = json.dumps(payload, sort_keys=True, separators=(",", ":"))
    checksum = hashlib.sha256(canonical.replace(f'"{marker}"', nested(":")).encode()).hexdigest()
    document = json.dumps({"format": 1, "checksum": checksum, "payload": payload})
    return document.replace(f'"{marker}"', nested(": "))


DEPTHS = [400, 900, 990, 200_000]  # from past Python's limit when other frames are on the stack


@pytest.mark.parametrize("depth", DEPTHS)
@pytest.mark.parametrize(
    "path",
    [("winner", "window"), ("key", "problem", "head_dim"), ("candidates", 0), ("tuned_shape",)],
    ids=["winner", "key", "candidate", "shape"],
)
def test_a_deeply_nested_record_is_a_miss_and_cache_list_shows_it(caplog, path, depth):
    record = _record()
    db = TuningDB()
    db.save(record)
    db.path(record.key).write_text(deep_document(record.payload(), path, depth))
    p = problem(dtype="float16", head_dim=64, causal=True)
    with (
        caplog.at_level(logging.WARNING, logger="kernelgen.tuning"),
        pytest.raises(TuningMissError),
    ):
        select_launch(p, A100, software=SOFTWARE, mode="offline", db=db)
    assert "nested more than 16 levels deep" in caplog.text
    listed = runner.invoke(app, ["cache", "list"])
    assert listed.exit_code == 0, listed.output
    assert "(unreadable)" in listed.stdout


@pytest.mark.parametrize("depth", DEPTHS)
@pytest.mark.parametrize("path", [("records",), ("records", 0, "winner")], ids=["bundle", "record"])
def test_importing_a_deeply_nested_bundle_is_one_line_and_exit_2(
    tmp_path, monkeypatch, path, depth
):
    monkeypatch.setattr(cli_tune, "current_environment", lambda: (A100, SOFTWARE))
    payload = {"kind": "kernelgen-tuning-export", "records": [_record().payload()]}
    bundle = tmp_path / "deep.json"
    bundle.write_text(deep_document(payload, path, depth))
    result = runner.invoke(app, ["cache", "import", str(bundle)])
    assert result.exit_code == 2, result.output
    assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.output
    assert "nested more than 16 levels deep" in result.stderr
    assert TuningDB().records() == []


# --- manifest.json that is not a manifest ----------------------------------------------------


@pytest.mark.parametrize(
    "manifest", ["[1, 2]", '"text"', '{"kernels": [1]}', '{"kernels": {"a": 1}}']
)
def test_a_manifest_that_is_not_an_object_is_reported_and_replaced(tmp_path, monkeypatch, manifest):
    fake_build(monkeypatch)
    spec_file = tmp_path / "s.yaml"
    spec_file.write_text(GOOD)
    out = tmp_path / "gen"
    out.mkdir()
    (out / "manifest.json").write_text(manifest)
    checked = runner.invoke(app, ["build", str(spec_file), "-o", str(out), "--check"])
    assert checked.exit_code == 1, checked.output
    assert "Traceback" not in checked.output
    assert f"{out / 'manifest.json'}: not a kernelgen manifest" in checked.stderr
    built = runner.invoke(app, ["build", str(spec_file), "-o", str(out)])
    assert built.exit_code == 0, built.output
    assert "warning: " in built.stderr and "not a kernelgen manifest" in built.stderr
    uri = load_spec(spec_file).uri
    assert set(json.loads((out / "manifest.json").read_text())["kernels"]) == {uri}
    assert runner.invoke(app, ["build", str(spec_file), "-o", str(out), "--check"]).exit_code == 0


# --- file modes follow the umask; private folders stay private ------------------------------


@pytest.fixture
def umask():
    """Set the process umask for one test (restored afterwards)."""
    previous = os.umask(0o022)
    yield lambda mask: os.umask(mask)
    os.umask(previous)


@pytest.mark.parametrize("mask, expected", [(0o022, 0o644), (0o002, 0o664), (0o077, 0o600)])
def test_generated_sources_manifests_and_records_follow_the_umask(tmp_path, umask, mask, expected):
    umask(mask)
    (tmp_path / "s.yaml").write_text(GOOD)
    spec = load_spec(tmp_path / "s.yaml")
    write_generated([BuiltKernel(spec, render(spec))], tmp_path / "gen")
    assert mode_of(tmp_path / "gen" / f"{spec.uri}.cu") == expected
    assert mode_of(tmp_path / "gen" / "manifest.json") == expected
    record = _record()
    db = TuningDB()
    assert db.save(record)
    assert mode_of(db.path(record.key)) == expected
    atomic_write_text(tmp_path / "secret", "x", private=True)
    assert mode_of(tmp_path / "secret") == 0o600


def test_private_folders_stay_private_under_a_loose_umask(tmp_path, umask, monkeypatch):
    umask(0o000)
    monkeypatch.setenv("KG_EMULATOR_CACHE", str(tmp_path / "emu"))
    assert mode_of(emulator_kernel.cache_dir()) == 0o700
    monkeypatch.setenv("KERNELGEN_FAILED_DIR", str(tmp_path / "failed"))
    saved = Path(save_failed_source("k", "//\n"))
    assert mode_of(saved) == 0o600 and mode_of(saved.parent) == 0o700
    assert mode_of(tmp_path / "failed") == 0o755  # a parent it made: not writable by others
