"""``python -m bench.ncu_summary``: what one ncu source page says, per opcode and per instruction.

Reads the per-instruction source page that ``bench.ncu_pair`` writes (``LABEL-source.csv.gz``,
or the plain CSV of ``ncu --page source --csv --print-source sass``) and prints, without a GPU:
the executed instructions and stall samples in all; both per opcode (``HGMMA``, ``MUFU``,
``SYNCS``, ...); the instructions with the most samples, with their stall reasons; and the
mbarrier waits with their executions (a wait whose retry path runs often is where warps waited
for another role). Two files give two columns per opcode, side by side.
"""

from __future__ import annotations

import argparse
import csv
import gzip
import io
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from bench.report import md_table

SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"
STALL_PREFIX = "stall_"


@dataclass(frozen=True)
class Instruction:
    offset: int
    text: str
    executed: int
    samples: int
    stalls: dict[str, int]  # reason -> samples (all samples, issued or not)

    @property
    def opcode(self) -> str:
        """The opcode without its modifiers or predicate (``@!P0 BRA`` -> ``BRA``)."""
        words = self.text.split()
        word = words[1] if words and words[0].startswith("@") and len(words) > 1 else words[0]
        return word.split(".")[0]


def read_source(path: Path) -> tuple[str, list[Instruction]]:
    """(kernel name, instructions in address order) from an ncu source-page CSV (gzip or not)."""
    raw = path.read_bytes()
    text = gzip.decompress(raw).decode() if raw[:2] == b"\x1f\x8b" else raw.decode()
    rows = list(csv.reader(io.StringIO(text)))
    if len(rows) < 3 or rows[0][:1] != ["Kernel Name"]:
        raise ValueError(f"{path}: not an ncu source page (no 'Kernel Name' line first)")
    kernel, header = rows[0][1], rows[1]
    missing = [c for c in ("Address", "Source", EXECUTED, SAMPLES) if c not in header]
    if missing:
        raise ValueError(f"{path}: no column {missing[0]!r} in the source page")
    at = {name: header.index(name) for name in header}
    reasons = [c for c in header if c.startswith(STALL_PREFIX) and "(Not Issued)" not in c]
    base = int(rows[2][at["Address"]], 16)
    return kernel, [
        Instruction(
            offset=int(r[at["Address"]], 16) - base,
            text=r[at["Source"]].strip(),
            executed=_int(r[at[EXECUTED]]),
            samples=_int(r[at[SAMPLES]]),
            stalls={c.removeprefix(STALL_PREFIX): _int(r[at[c]]) for c in reasons},
        )
        for r in rows[2:]
        if len(r) == len(header)
    ]


def _int(text: str) -> int:
    return int(text.replace(",", "")) if text.strip() not in ("", "-") else 0


def by_opcode(instructions: list[Instruction]) -> dict[str, tuple[int, int]]:
    """opcode -> (executed, samples)."""
    totals: dict[str, tuple[int, int]] = {}
    for i in instructions:
        executed, samples = totals.get(i.opcode, (0, 0))
        totals[i.opcode] = (executed + i.executed, samples + i.samples)
    return totals


def top_reasons(stalls: dict[str, int], count: int = 2) -> str:
    ranked = sorted(((n, r) for r, n in stalls.items() if n), reverse=True)[:count]
    return ", ".join(f"{r} {n}" for n, r in ranked)


def label(path: Path) -> str:
    """A column's name: the file name without ``-source``, ``.csv`` and ``.gz``."""
    return path.name.removesuffix(".gz").removesuffix(".csv").removesuffix("-source")


def summary_lines(path: Path, kernel: str, instructions: list[Instruction]) -> str:
    executed = sum(i.executed for i in instructions)
    samples = sum(i.samples for i in instructions)
    return (
        f"{label(path)}: {kernel}, {len(instructions)} SASS instructions, {executed:,} executed, "
        f"{samples:,} stall samples"
    )


def opcode_table(paths: Sequence[Path], read: list[list[Instruction]], top: int) -> str:
    """Executed instructions and the share of stall samples per opcode, a column pair a file."""
    opcodes = [by_opcode(instructions) for instructions in read]
    totals = [sum(s for _, s in o.values()) or 1 for o in opcodes]
    names = sorted({n for o in opcodes for n in o},
                   key=lambda n: -sum(o.get(n, (0, 0))[1] for o in opcodes))  # fmt: skip
    header = ["opcode"] + [f"{label(p)} {col}" for p in paths for col in ("executed", "samples")]
    rows = []
    for name in names[:top]:
        cells = [name]
        for o, total in zip(opcodes, totals, strict=True):
            executed, samples = o.get(name, (0, 0))
            cells += [f"{executed:,}", f"{100 * samples / total:.1f} %"]
        rows.append(cells)
    return md_table(header, rows, ["---"] + ["---:"] * (len(header) - 1))


def hot_table(instructions: list[Instruction], top: int) -> str:
    """The instructions with the most stall samples, with their two main reasons."""
    total = sum(i.samples for i in instructions) or 1
    hot = sorted(instructions, key=lambda i: -i.samples)[:top]
    rows = [
        [f"{i.offset:#06x}", i.text[:60], f"{i.executed:,}", f"{100 * i.samples / total:.1f} %",
         top_reasons(i.stalls)]
        for i in hot
    ]  # fmt: skip
    header = ["offset", "instruction", "executed", "samples", "top reasons"]
    return md_table(header, rows, ["---:", "---", "---:", "---:", "---"])


def wait_table(instructions: list[Instruction]) -> str:
    """Every mbarrier wait (SYNCS ... TRYWAIT) and how often it ran: a retry path that runs
    often is where warps waited for another role."""
    waits = [i for i in instructions if i.opcode == "SYNCS" and "TRYWAIT" in i.text]
    rows = [[f"{i.offset:#06x}", i.text[:70], f"{i.executed:,}"] for i in waits]
    return md_table(["offset", "instruction", "executed"], rows, ["---:", "---", "---:"])


def report(paths: Sequence[Path], top: int) -> str:
    read = [read_source(p) for p in paths]
    out = [summary_lines(p, kernel, ins) for p, (kernel, ins) in zip(paths, read, strict=True)]
    out += ["", opcode_table(paths, [ins for _, ins in read], top)]
    for path, (_, instructions) in zip(paths, read, strict=True):
        out += ["", f"{label(path)}: the instructions with the most stall samples", ""]
        out += [hot_table(instructions, top), "", f"{label(path)}: mbarrier waits", ""]
        out.append(wait_table(instructions))
    return "\n".join(out)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.ncu_summary", description=__doc__)
    parser.add_argument("sources", nargs="+", type=Path, help="ncu source-page CSV (.csv.gz)")
    parser.add_argument("--top", type=int, default=15, help="rows per table (default 15)")
    args = parser.parse_args(argv)
    try:
        print(report(args.sources, args.top))
    except (OSError, ValueError) as exc:
        print(f"ncu_summary: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
