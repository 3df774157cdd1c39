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
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kernelgen.fileio import atomic_write_text
from kernelgen.tuning.key import TuningKey, canonical_digest

log = logging.getLogger(__name__)

FORMAT = 1
EXPORT_KIND = "kernelgen-tuning-export"
_WARNED_READ_ONLY: set[str] = set()
_WARNED_CORRUPT: set[tuple[str, int, int]] = set()  # (path, size, mtime_ns) already reported


def cache_dir() -> Path:
    """``$KERNELGEN_CACHE_DIR``, else ``$XDG_CACHE_HOME/kernelgen``, else ``~/.cache/kernelgen``."""
    if explicit := os.environ.get("KERNELGEN_CACHE_DIR"):
        return Path(explicit).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "kernelgen"


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
    winner: dict[str, Any]  # the winning spec's fields
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
    def from_payload(cls, payload: dict[str, Any]) -> TuningRecord:
        try:
            return cls(
                key=TuningKey.from_dict(payload["key"]),
                winner=dict(payload["winner"]),
                candidates=list(payload["candidates"]),
                dropped=list(payload["dropped"]),
                tuned_shape=dict(payload["tuned_shape"]),
                created=str(payload["created"]),
                winner_launch=_launch_fields(payload.get("winner_launch")),
            )
        except (KeyError, TypeError) as exc:
            raise ValueError(f"malformed record: {exc!r}") from None

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
        return self.dir / f"{key if isinstance(key, str) else key.id}.json"

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
            return TuningRecord.from_payload(unwrap(json.loads(data)))
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
            fd = os.open(self.dir / f"{key.id}.lock", os.O_RDWR | os.O_CREAT, 0o644)
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
            bundle = unwrap(json.loads(Path(path).read_bytes()))
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
