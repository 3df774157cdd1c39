"""Reading committed result files (pure, no GPU): the prefill documents, their provenance, and
the figures a row carries whether it was written before timing rounds existed or after.

A result file's ``meta.git_commit`` is what the machine that ran it believed; a provenance
sidecar (``*-provenance.json`` beside the result files: ``{"runs": {name: {"commit": ...,
"files": [glob, ...]}}}``) overrides it for the files it names, because a copied working tree
can carry another commit's git metadata.
"""

from __future__ import annotations

import fnmatch
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.report import READABLE_SCHEMAS
from kernelgen.errors import InputError

PROVENANCE_GLOB = "*-provenance.json"


@dataclass(frozen=True)
class Provenance:
    """Which code a result file measured: the commit (short form in tables), whether the tree
    was dirty (None: unknown), and where the commit was read from."""

    commit: str
    dirty: bool | None
    source: str  # "meta" or the sidecar's file name

    @property
    def short(self) -> str:
        return self.commit[:7] if self.commit not in ("", "unknown") else "unknown"

    def describe(self) -> str:
        """``commit 14b11b4 (per 2026-11-26-h100-provenance.json)``, ``commit 6b9a42d (dirty
        tree)``: the words a table's heading uses."""
        text = f"commit {self.short}"
        if self.source != "meta":
            return f"{text} (per {self.source})"
        return f"{text} (dirty tree)" if self.dirty else text


def load_json(path: Path) -> dict[str, Any]:
    """A JSON object from ``path``; an InputError naming the file when it is not one."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise InputError(f"{path}: not a readable JSON file ({exc})") from None
    if not isinstance(data, dict):
        raise InputError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def load_prefill(path: Path) -> dict[str, Any]:
    """A ``bench.attention`` result document (any schema version: rows without timing rounds
    read as before); an InputError when it lacks ``meta`` or ``rows``."""
    data = load_json(path)
    missing = [key for key in ("meta", "rows") if key not in data]
    if missing:
        raise InputError(f"{path}: not a bench.attention result file (no {', '.join(missing)})")
    schema = data.get("schema", 1)
    if schema not in READABLE_SCHEMAS:
        readable = ", ".join(map(str, READABLE_SCHEMAS))
        raise InputError(f"{path}: schema {schema!r}; this bench reads schemas {readable}")
    return data


def sidecar_commits(results_dir: Path) -> dict[str, tuple[str, str]]:
    """{glob pattern: (commit, sidecar name)} from every provenance sidecar in ``results_dir``."""
    found: dict[str, tuple[str, str]] = {}
    for path in sorted(results_dir.glob(PROVENANCE_GLOB)):
        runs = load_json(path).get("runs", {})
        if not isinstance(runs, dict):
            raise InputError(f"{path}: 'runs' must be an object of runs")
        for name, run in runs.items():
            if not isinstance(run, dict) or not isinstance(run.get("commit"), str):
                raise InputError(f"{path}: run {name!r} has no 'commit' string")
            for pattern in run.get("files", []):
                found[pattern] = (run["commit"], path.name)
    return found


def provenance(path: Path, meta: dict[str, Any]) -> Provenance:
    """The commit ``path`` measured: a sidecar's when one names the file, else ``meta``'s."""
    for pattern, (commit, source) in sidecar_commits(path.parent).items():
        if fnmatch.fnmatchcase(path.name, pattern):
            return Provenance(commit, False, source)
    return Provenance(str(meta.get("git_commit") or "unknown"), meta.get("git_dirty"), "meta")


def device(meta: dict[str, Any]) -> str:
    """``NVIDIA H100 80GB HBM3 (sm_90, 132 SMs, driver 580.159.04)``."""
    return (
        f"{meta.get('gpu_name', '?')} (sm_{meta.get('compute_capability', '?')}, "
        f"{meta.get('sm_count', '?')} SMs, driver {meta.get('driver_version', '?')})"
    )


def rows_by(data: dict[str, Any]) -> dict[tuple[str, str], dict[str, Any]]:
    """{(shape key, peer): row}."""
    return {(row["shape"], row["peer"]): row for row in data["rows"]}


def shape_keys(data: dict[str, Any]) -> list[str]:
    """The shapes of a result file in the order it ran them."""
    listed = data.get("settings", {}).get("shapes")
    if listed:
        return list(listed)
    return list(dict.fromkeys(row["shape"] for row in data["rows"]))
