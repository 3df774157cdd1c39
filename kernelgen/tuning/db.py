"""The persistent tuning database: one checksummed JSON file per key under the cache dir.

Writes are atomic (temp file beside the target, then ``os.replace``); a file lock serializes
processes tuning the same key; a corrupt, truncated or foreign file is a miss with a warning;
a read-only directory works without persistence (one warning per process and directory).
Lock files stay when records are cleared: a process may hold one, and a new file of the same
name would let a second process in beside it.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kernelgen.errors import InputError, SpecError
from kernelgen.families import family_of, spec_of_family
from kernelgen.fileio import atomic_write_text, kernelgen_cache_dir
from kernelgen.specs.arch import ARCHS
from kernelgen.specs.backward import BackwardSpec
from kernelgen.tuning.key import TuningKey, canonical_digest, spec_fields

log = logging.getLogger(__name__)

FORMAT = 1
EXPORT_KIND = "kernelgen-tuning-export"
_WARNED_READ_ONLY: set[str] = set()
_WARNED_CORRUPT: set[tuple[str, int, int]] = set()  # (path, size, mtime_ns) already reported
_KEY_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_]*-[0-9a-f]{12}")  # ProblemBucket.label-digest


def cache_dir() -> Path:
    """``$KERNELGEN_CACHE_DIR``, else ``$XDG_CACHE_HOME/kernelgen``, else ``~/.cache/kernelgen``."""
    return kernelgen_cache_dir()


def wrap(payload: dict[str, Any]) -> dict[str, Any]:
    """The on-disk document: format, checksum of the canonical payload, payload."""
    return {"format": FORMAT, "checksum": canonical_digest(payload), "payload": payload}


def unwrap(document: Any) -> dict[str, Any]:
    """The payload of a document, or ValueError saying what is wrong with it."""
    if not isinstance(document, dict) or document.get("format") != FORMAT:
        raise ValueError(f"not a format-{FORMAT} kernelgen document")
    payload = document.get("payload")
    if not isinstance(payload, dict) or canonical_digest(payload) != document.get("checksum"):
        raise ValueError("checksum mismatch")
    return payload


@dataclass(frozen=True)
class TuningRecord:
    """One tuned key: the winner and every candidate's outcome (see docs/autotuning.md)."""

    key: TuningKey
    winner: dict[str, Any]  # the winning spec's fields (a backward key: a backward spec's)
    candidates: list[dict[str, Any]]  # uri, spec, median_ms (None = failed), status, reason
    dropped: list[dict[str, Any]]  # uri, stage, reason
    tuned_shape: dict[str, Any]
    created: str
    # how the winner is launched: {"num_splits": n} (n None: the launch heuristic); records
    # written before split-KV have none
    winner_launch: dict[str, Any] | None = None

    def payload(self) -> dict[str, Any]:
        return {
            "key": self.key.as_dict(),
            "key_id": self.key.id,
            "winner": self.winner,
            "winner_launch": self.winner_launch,
            "candidates": self.candidates,
            "dropped": self.dropped,
            "tuned_shape": self.tuned_shape,
            "created": self.created,
        }

    @classmethod
    def from_payload(cls, payload: Any) -> TuningRecord:
        """The record of a file's or a bundle's payload, every part checked: its key
        (:func:`~kernelgen.tuning.key.key_problems`), the shape of each list and a winner that
        is a valid spec for that key (:func:`winner_problems`); ValueError otherwise."""
        if not isinstance(payload, dict):
            raise ValueError(f"malformed record: a {type(payload).__name__}, not an object")
        try:
            record = cls(
                key=TuningKey.from_dict(payload["key"]),
                winner=_of_type(payload, "winner", dict),
                candidates=_list_of_objects(payload, "candidates"),
                dropped=_list_of_objects(payload, "dropped"),
                tuned_shape=_of_type(payload, "tuned_shape", dict),
                created=str(payload["created"]),
                winner_launch=_launch_fields(payload.get("winner_launch")),
            )
        except (KeyError, TypeError) as exc:
            raise ValueError(f"malformed record: {exc!r}") from None
        if problems := winner_problems(record):
            raise ValueError(f"its winner does not fit its key ({'; '.join(problems)})")
        return record

    @property
    def winner_splits(self) -> int | None:
        """The winner's split count (None: not fixed, the launch heuristic decides)."""
        return (self.winner_launch or {}).get("num_splits")

    @property
    def winner_ms(self) -> float | None:
        for c in self.candidates:
            if c.get("status") == "winner":
                return c.get("median_ms")
        return None


def _of_type(payload: dict[str, Any], name: str, kind: type) -> Any:
    value = payload[name]
    if not isinstance(value, kind):
        raise ValueError(f"malformed record: {name} is a {type(value).__name__}")
    return kind(value)


def _list_of_objects(payload: dict[str, Any], name: str) -> list[dict[str, Any]]:
    items = _of_type(payload, name, list)
    if not all(isinstance(item, dict) for item in items):
        raise ValueError(f"malformed record: {name} holds something that is not an object")
    return items


def winner_problems(record: TuningRecord) -> list[str]:
    """Why ``record``'s winner cannot run its key's problem (empty: it can): not a valid spec,
    a spec of the other family (a forward spec for a backward key or the reverse), another
    dtype, head dim, mask, layout, set of variants or dQ mode, an architecture the key's device
    does not get, or a split count for a kernel that does not split."""
    try:
        spec = spec_of_family(record.winner)
    except SpecError as exc:
        return [f"not a valid spec: {'; '.join(exc.problems)}"]
    bucket = record.key.problem
    if family_of(spec) != bucket.family:
        return [f"a {family_of(spec)} spec, the key is a {bucket.family} problem"]
    problems = [
        f"{name}={getattr(spec, name)!r}, the key has {value!r}"
        for name, value in spec_fields(bucket).items()
        if getattr(spec, name) != value
    ]
    if set(spec.variants) != set(bucket.variants):
        problems.append(f"variants {list(spec.variants)}, the key has {list(bucket.variants)}")
    try:
        arch = record.key.device.target_arch
    except InputError as exc:
        return [*problems, str(exc)]
    capability = ARCHS[arch].compute_capability  # sm_90a code is for a 9.0 device too
    if all(ARCHS[a].compute_capability != capability for a in spec.archs):
        problems.append(f"archs {list(spec.archs)}, the key's device is {arch}")
    splits = not isinstance(spec, BackwardSpec) and spec.split_kv
    if record.winner_splits is not None and not splits:
        problems.append(f"{record.winner_splits} splits for a kernel without split_kv")
    return problems


MAX_DEPTH = 16  # nested JSON containers of a document: a bundle's spec archs are 8 deep


def load_document(data: bytes) -> Any:
    """Parse a record file or a bundle: ValueError when it is not JSON or is nested deeper than
    :data:`MAX_DEPTH` (never RecursionError, here or in what later walks the value)."""
    try:
        document = json.loads(data)
    except RecursionError:
        raise ValueError(f"nested more than {MAX_DEPTH} levels deep") from None
    level = [document] if isinstance(document, dict | list) else []
    for _ in range(MAX_DEPTH):  # one level at a time: no recursion however deep the value is
        level = [
            child
            for container in level
            for child in (container.values() if isinstance(container, dict) else container)
            if isinstance(child, dict | list)
        ]
    if level:
        raise ValueError(f"nested more than {MAX_DEPTH} levels deep")
    return document


def decode_record(data: bytes) -> TuningRecord:
    """The record in a file's bytes; ValueError when it is unusable."""
    return TuningRecord.from_payload(unwrap(load_document(data)))


def _launch_fields(value: Any) -> dict[str, Any] | None:
    """A record's ``winner_launch``, checked: None or ``{"num_splits": positive int or None}``."""
    if value is None:
        return None
    splits = value.get("num_splits") if isinstance(value, dict) else "?"
    if splits is not None and (
        isinstance(splits, bool) or not isinstance(splits, int) or splits < 1
    ):
        raise ValueError(f"malformed record: winner_launch={value!r}")
    return {"num_splits": splits}


class TuningDB:
    """Records under ``<root>/tuning/<key id>.json`` (``root`` defaults to :func:`cache_dir`)."""

    def __init__(self, root: str | Path | None = None) -> None:
        self.root = Path(root) if root is not None else cache_dir()
        self.dir = self.root / "tuning"

    def path(self, key: TuningKey | str) -> Path:
        """``<dir>/<key id>.json``; ValueError for an id that would name a file elsewhere."""
        key_id = key if isinstance(key, str) else key.id
        path = self.dir / f"{key_id}.json"
        if not _KEY_ID.fullmatch(key_id) or path.resolve().parent != self.dir.resolve():
            raise ValueError(f"tuning key id {key_id!r:.80} does not name a file in {self.dir}")
        return path

    def _warn_read_only(self, exc: OSError) -> None:
        if str(self.dir) not in _WARNED_READ_ONLY:
            _WARNED_READ_ONLY.add(str(self.dir))
            log.warning(
                "tuning cache %s is not writable (%s); tuning results will not persist",
                self.dir,
                exc.strerror or exc,
            )

    def read_path(self, path: Path) -> TuningRecord | None:
        """The record in ``path``; None (with a warning) when it is missing or unusable."""
        try:
            data = path.read_bytes()
            stat = path.stat()
        except FileNotFoundError:
            return None
        except OSError as exc:
            log.warning("cannot read tuning record %s: %s; treating it as a miss", path, exc)
            return None
        try:
            return decode_record(data)
        except ValueError as exc:
            seen = (str(path), stat.st_size, stat.st_mtime_ns)
            if seen not in _WARNED_CORRUPT:  # once per file version, not per lookup
                _WARNED_CORRUPT.add(seen)
                log.warning(
                    "ignoring corrupt tuning record %s (%s); treating it as a miss", path, exc
                )
            return None

    def load(self, key: TuningKey) -> TuningRecord | None:
        """The record for exactly ``key``, or None (a record for another key is never used)."""
        record = self.read_path(self.path(key))
        if record is not None and record.key != key:
            log.warning("tuning record %s holds another key; treating it as a miss", key.id)
            return None
        return record

    def write(self, record: TuningRecord) -> None:
        """Write ``record`` to its file atomically (OSError when the directory is not writable)."""
        text = json.dumps(wrap(record.payload()), indent=1, sort_keys=True, allow_nan=False)
        atomic_write_text(self.path(record.key), text + "\n")

    def save(self, record: TuningRecord) -> bool:
        """:meth:`write`; False (and one warning) when the directory is read-only."""
        try:
            self.write(record)
        except OSError as exc:
            self._warn_read_only(exc)
            return False
        return True

    @contextlib.contextmanager
    def lock(self, key: TuningKey) -> Iterator[None]:
        """Exclusive ``flock`` on ``<key id>.lock`` (no lock where the directory is read-only)."""
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path(key).with_suffix(".lock"), os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            self._warn_read_only(exc)
            yield
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # closing releases the lock

    def records(self) -> list[tuple[Path, TuningRecord | None]]:
        """Every record file, sorted by name (None where the file is unusable)."""
        if not self.dir.is_dir():
            return []
        return [(p, self.read_path(p)) for p in sorted(self.dir.glob("*.json"))]

    def find(self, key_id: str) -> Path:
        """The record file whose key id is ``key_id`` or starts with it (KeyError otherwise)."""
        matches = [p for p, _ in self.records() if p.stem == key_id]
        matches = matches or [p for p, _ in self.records() if p.stem.startswith(key_id)]
        if len(matches) != 1:
            found = "no record" if not matches else f"{len(matches)} records"
            raise KeyError(f"{found} matches key {key_id!r}; see `kernelgen cache list`")
        return matches[0]

    def clear(self) -> int:
        """Remove every record (lock files stay, see the module docstring); returns the count."""
        removed = 0
        for path in self.dir.glob("*.json") if self.dir.is_dir() else []:
            path.unlink(missing_ok=True)
            removed += 1
        return removed

    def export(self, path: str | Path) -> int:
        """Write every valid record to one checksummed JSON bundle; returns the count."""
        payloads = [r.payload() for _, r in self.records() if r is not None]
        bundle = wrap({"kind": EXPORT_KIND, "records": payloads})
        atomic_write_text(path, json.dumps(bundle, indent=1, sort_keys=True) + "\n")
        return len(payloads)

    @staticmethod
    def read_bundle(path: str | Path) -> list[TuningRecord]:
        """Every record of an export bundle, all checked before any is used: ValueError naming
        the file (and the record) when the bundle or one of its records is unusable."""
        try:
            bundle = unwrap(load_document(Path(path).read_bytes()))
        except OSError as exc:
            raise ValueError(f"cannot read {path}: {exc.strerror or exc}") from None
        except ValueError as exc:
            raise ValueError(f"{path} is not a kernelgen tuning export: {exc}") from None
        if bundle.get("kind") != EXPORT_KIND or not isinstance(bundle.get("records"), list):
            raise ValueError(f"{path} is not a kernelgen tuning export")
        records = []
        for index, payload in enumerate(bundle["records"]):
            try:
                records.append(TuningRecord.from_payload(payload))
            except ValueError as exc:
                raise ValueError(f"{path}: record {index} is unusable ({exc})") from None
        return records

    def import_records(
        self, records: list[TuningRecord], environment_id: str | None
    ) -> tuple[int, list[str]]:
        """Store the records whose device and software match ``environment_id``.

        Returns (imported count, one line per rejected record); OSError when the directory is
        not writable."""
        imported, rejected = 0, []
        for record in records:
            if record.key.environment_id != environment_id:
                dev, sw = record.key.device, record.key.software
                rejected.append(
                    f"rejected {record.key.id}: tuned on {dev.name} (sm {dev.compute_capability}, "
                    f"{dev.sm_count} SMs) with kernelgen {sw.kernelgen}, templates "
                    f"{sw.template_hash[:12]}, NVRTC {sw.nvrtc}, CuPy {sw.cupy}; this machine's "
                    "device/software key differs"
                )
                continue
            self.write(record)
            imported += 1
        return imported, rejected
