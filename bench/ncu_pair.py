"""``python -m bench.ncu_pair``: Nsight Compute reports of a few specs, side by side.

Each ``LABEL=SPEC.yaml[,FIELD=VALUE...]`` item is one forward spec (a shipped YAML with fields
overridden, as ``bench.profile_launch --set`` takes them). For each, ncu records one launch of
``python -m bench.profile_launch`` (``--set full``) into ``OUT/LABEL.ncu-rep``, then writes its
details page (``LABEL-details.txt``) and its per-instruction source page with SASS
(``LABEL-source.csv.gz``: executed instructions and stall samples per instruction). The
session's ``profile`` stage runs it on the plain loop and Q in registers (bench/README.md).
``--dry-run`` only builds the specs (no GPU, no ncu).
"""

from __future__ import annotations

import gzip
import os
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from bench.profile_launch import build_items, items_parser

NCU_FALLBACK = "/usr/local/cuda/bin/ncu"
RECORD_TIMEOUT_S = 120  # one ncu recording (a few launches, --set full replays one)
EXPORT_TIMEOUT_S = 60


def ncu_path() -> str | None:
    found = shutil.which("ncu")
    return found or (NCU_FALLBACK if os.access(NCU_FALLBACK, os.X_OK) else None)


def record(ncu: str, out: Path, label: str, path: Path, overrides: list[str], seqlen: int) -> str:
    """Record, export and compress one spec's report; the first line of what went wrong, or ''."""
    sets = [arg for override in overrides for arg in ("--set", override)]
    launch = [
        sys.executable,
        "-m",
        "bench.profile_launch",
        str(path),
        *sets,
        "--seqlen",
        str(seqlen),
    ]
    report = out / label
    steps = [
        ([ncu, "--kernel-name", "regex:fa_fwd", "--launch-skip", "2", "--launch-count", "1",
          "--set", "full", "--import-source", "no", "-f", "-o", str(report), *launch],
         out / f"{label}.log", RECORD_TIMEOUT_S),
        ([ncu, "--import", f"{report}.ncu-rep", "--page", "details"],
         out / f"{label}-details.txt", EXPORT_TIMEOUT_S),
        ([ncu, "--import", f"{report}.ncu-rep", "--page", "source", "--csv", "--print-source",
          "sass"], out / f"{label}-source.csv", EXPORT_TIMEOUT_S),
    ]  # fmt: skip
    for command, log, timeout in steps:
        with open(log, "w") as handle:
            try:
                done = subprocess.run(command, stdout=handle, stderr=subprocess.STDOUT,
                                      timeout=timeout, check=False)  # fmt: skip
            except subprocess.TimeoutExpired:
                return f"{label}: {Path(command[0]).name} timed out after {timeout} s"
        if done.returncode != 0:
            return f"{label}: exit {done.returncode} (see {log.name})"
    source = out / f"{label}-source.csv"
    with open(source, "rb") as raw, gzip.open(f"{source}.gz", "wb") as packed:
        shutil.copyfileobj(raw, packed)
    source.unlink()
    return ""


def main(argv: Sequence[str] | None = None) -> int:
    parser = items_parser("python -m bench.ncu_pair", __doc__, "ncu-out")
    parser.add_argument("--seqlen", type=int, default=4096)
    args = parser.parse_args(argv)
    if build_items(args.items, "ncu_pair") is None:
        return 2
    if args.dry_run:
        return 0
    ncu = ncu_path()
    if ncu is None:
        print("ncu_pair: no ncu on PATH or at /usr/local/cuda/bin", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    problems = [p for label, path, overrides in args.items
                if (p := record(ncu, args.out, label, path, overrides, args.seqlen))]  # fmt: skip
    for p in problems:
        print(f"ncu_pair: {p}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
