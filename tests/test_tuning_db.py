"""CPU tier: the tuning database's file format, atomicity, corruption, locking, permissions."""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import time
from pathlib import Path

import pytest
from test_tuning_fakes import DEVICE, SOFTWARE, fake_tuner, problem

from kernelgen.tuning import TuningDB, clear_memo, make_key, select_spec
from kernelgen.tuning.db import cache_dir, unwrap


@pytest.fixture(autouse=True)
def isolated(tuning_sandbox):
    """Every test gets its own tuning cache and memo (conftest)."""


def saved_record(p=None):
    p = p or problem()
    key = make_key(p, DEVICE, SOFTWARE)
    record = fake_tuner()(p, key)
    db = TuningDB()
    assert db.save(record)
    return db, key, record


def test_cache_dir_defaults(monkeypatch, tmp_path):
    monkeypatch.delenv("KERNELGEN_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "kernelgen"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_dir() == tmp_path / "home" / ".cache" / "kernelgen"


def test_record_file_format():
    db, key, record = saved_record()
    path = db.path(key)
    assert path.name == f"{key.id}.json" and path.parent == cache_dir() / "tuning"
    document = json.loads(path.read_text())
    assert set(document) == {"format", "checksum", "payload"}
    payload = unwrap(document)
    assert payload["key"] == key.as_dict() and payload["key_id"] == key.id
    assert len(payload["candidates"]) == len(record.candidates) > 1
    assert db.load(key) == record


def test_a_crash_mid_write_leaves_the_old_file_valid(monkeypatch):
    db, key, record = saved_record()
    before = db.path(key).read_bytes()
    newer = fake_tuner()(problem(seqlen_q=1000), key)

    def crash(fd):
        raise SystemExit("killed while writing")

    monkeypatch.setattr(os, "fsync", crash)
    with pytest.raises(SystemExit):
        db.save(newer)
    monkeypatch.undo()
    assert db.path(key).read_bytes() == before
    assert db.load(key) == record
    assert [p.name for p in db.dir.iterdir() if p.suffix == ".tmp"] == []


@pytest.mark.parametrize("damage", ["truncate", "garbage", "tamper", "empty"])
def test_a_corrupt_file_is_a_miss_with_a_warning(damage, caplog):
    db, key, _ = saved_record()
    path = db.path(key)
    text = path.read_text()
    if damage == "truncate":
        path.write_text(text[: len(text) // 2])
    elif damage == "garbage":
        path.write_bytes(b"\x00\xff not json")
    elif damage == "tamper":
        path.write_text(text.replace('"block_n": ', '"block_n": 1', 1))
    else:
        path.write_text("")
    with caplog.at_level(logging.WARNING, logger="kernelgen.tuning"):
        assert db.load(key) is None
        assert db.load(key) is None  # a lookup reads twice (before and under the lock)
    assert sum("corrupt" in r.message for r in caplog.records) == 1
    clear_memo()  # select_spec re-tunes and replaces the file
    select_spec(problem(), DEVICE, software=SOFTWARE, tuner=fake_tuner())
    assert db.load(key) is not None


def _race_worker(cache: str, counter: str, barrier) -> None:
    os.environ["KERNELGEN_CACHE_DIR"] = cache
    inner = fake_tuner()

    def slow_tuner(p, key):
        with open(counter, "a") as handle:
            handle.write(f"{os.getpid()}\n")
        time.sleep(0.3)
        return inner(p, key)

    barrier.wait()
    spec = select_spec(problem(), DEVICE, software=SOFTWARE, tuner=slow_tuner)
    with open(counter + ".uris", "a") as handle:
        handle.write(spec.uri + "\n")


def test_eight_processes_racing_on_one_key_tune_once(tmp_path):
    context = multiprocessing.get_context("fork")
    counter = str(tmp_path / "tuned.txt")
    barrier = context.Barrier(8)
    workers = [
        context.Process(
            target=_race_worker, args=(os.environ["KERNELGEN_CACHE_DIR"], counter, barrier)
        )
        for _ in range(8)
    ]
    for w in workers:
        w.start()
    for w in workers:
        w.join(60)
    assert [w.exitcode for w in workers] == [0] * 8
    assert len(Path(counter).read_text().splitlines()) == 1
    assert len(set(Path(counter + ".uris").read_text().splitlines())) == 1
    db = TuningDB()
    records = db.records()
    assert len(records) == 1 and records[0][1] is not None
    assert db.load(make_key(problem(), DEVICE, SOFTWARE)) is not None


def _deny_writes(monkeypatch) -> None:
    """What a read-only directory does to a process that permissions apply to."""
    from kernelgen.tuning import db as db_module

    def denied(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(db_module, "atomic_write_text", denied)
    monkeypatch.setattr(Path, "mkdir", denied)
    real_open = os.open
    monkeypatch.setattr(
        os, "open", lambda p, f, *a: denied() if f & os.O_CREAT else real_open(p, f, *a)
    )


@pytest.mark.parametrize("how", ["chmod", "simulated"])
def test_a_read_only_cache_dir_works_with_one_warning(how, tmp_path, monkeypatch, caplog):
    if how == "chmod" and os.geteuid() == 0:
        pytest.skip("root ignores directory permissions")
    cache = tmp_path / "cache"
    cache.mkdir()
    cache.chmod(0o500)
    if how == "simulated":
        _deny_writes(monkeypatch)
    try:
        tuned = []
        inner = fake_tuner()

        def tuner(p, key):
            tuned.append(key.id)
            return inner(p, key)

        with caplog.at_level(logging.WARNING, logger="kernelgen.tuning"):
            a = select_spec(problem(), DEVICE, software=SOFTWARE, tuner=tuner)
            b = select_spec(problem(seqlen_q=64), DEVICE, software=SOFTWARE, tuner=tuner)
            assert select_spec(problem(), DEVICE, software=SOFTWARE, tuner=tuner) == a
        assert a and b and len(tuned) == 2
        assert sum("not writable" in r.message for r in caplog.records) == 1
        assert list(cache.iterdir()) == []
    finally:
        cache.chmod(0o700)


def test_records_listing_skips_nothing_and_flags_corrupt_files():
    db, key, _ = saved_record()
    other = make_key(problem(dtype="float16"), DEVICE, SOFTWARE)
    (db.dir / f"{other.id}.json").write_text("{")
    listing = dict(db.records())
    assert listing[db.path(key)] is not None and listing[db.dir / f"{other.id}.json"] is None
    assert db.find(key.id[:10]) == db.path(key) or db.find(key.id) == db.path(key)
    with pytest.raises(KeyError):
        db.find("nope")


def test_clear_keeps_lock_files_a_tuner_may_hold():
    """Unlinking a held lock file would let a second tuner lock a new file of the same name."""
    db, key, _ = saved_record()
    with db.lock(key):
        assert db.clear() == 1
        assert (db.dir / f"{key.id}.lock").exists()
    assert db.load(key) is None and db.records() == []
