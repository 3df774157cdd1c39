"""``python -m bench.sass_loop``: the steady-state key-tile loop of tensor-core specs, from SASS.

No GPU needed (offline NVRTC plus the cuobjdump/nvdisasm wheels). For each tensor-core spec it
compiles an *interior* variant of the kernel, where every key tile takes the path of a tile
that hides no key (no bounds, causal or mask test: the case of all but the last few tiles of
a long sequence), finds the loop that issues the HMMAs (the backward branch around them) and
counts its instructions by opcode on the path where no row moves its softmax reference m (the
common case after a row's first tiles; the block a move adds is reported beside it). One warp
runs the body once per key tile, so
``issued / HMMA`` is the issue-slot cost each tensor-core instruction carries: the figure that
softmax and bookkeeping changes move. It is a static count, not a timing.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from bench.report import md_table
from kernelgen.compile import SassInstruction, sass_instructions

ROOT = Path(__file__).resolve().parent.parent
# What makes a key tile take the interior path in the tensor-core template, and what the interior
# variant writes instead: no key hidden and no mask (scores stay raw), and a full K/V tile to
# copy (no bounds test). Kept in sync by the check in interior_source().
INTERIOR = {
    "exact = tile >= first_exact || mask != nullptr;": "exact = false;",
    "if (key0 + BLOCK_N <= num_keys) {": "if (true) {",
}
COLUMNS = ("HMMA", "LDSM", "FMUL", "FFMA", "FADD", "FMNMX", "MUFU", "SHFL", "BAR")
_TARGET = re.compile(r"0x([0-9a-f]+)")


@dataclass(frozen=True)
class LoopBody:
    """Opcode families (text before the first dot) of one loop body, `@!PT` padding excluded:
    ``counts`` on the path of a tile where no row moves its reference m, ``rescale`` the
    instructions of the blocks that warp votes (VOTE.ANY, then a forward branch) skip there."""

    counts: dict[str, int]
    rescale: int = 0
    inner_loops: int = 0  # backward branches inside the body: their repeats are not counted

    @property
    def issued(self) -> int:
        return sum(self.counts.values())

    @property
    def per_hmma(self) -> float:
        return self.issued / self.counts.get("HMMA", 0)


def hmma_loop(sass: str) -> LoopBody:
    """The largest loop (backward branch) whose body holds HMMA instructions."""
    rows = sass_instructions(sass)
    best: LoopBody | None = None
    for end in rows:
        start = _backward_target(end)
        if start is None:
            continue
        body = [row for row in rows if start <= row.address <= end.address]
        skipped = _vote_skipped(body)
        counts = Counter(row.family for row in body if row.address not in skipped)
        if counts["HMMA"] and (best is None or sum(counts.values()) > best.issued):
            inner = sum(_backward_target(row) is not None for row in body[:-1])
            best = LoopBody(dict(counts), len(skipped), inner)
    if best is None:
        raise ValueError("no loop with HMMA instructions in the SASS")
    return best


def _branch_target(row: SassInstruction) -> int | None:
    target = _TARGET.search(row.operands) if row.family == "BRA" else None
    return None if target is None else int(target.group(1), 16)


def _backward_target(row: SassInstruction) -> int | None:
    target = _branch_target(row)
    return target if target is not None and target < row.address else None


def _vote_skipped(body: list[SassInstruction]) -> set[int]:
    """Addresses that the first forward branch after each VOTE.ANY jumps over."""
    skipped: set[int] = set()
    for i, row in enumerate(body):
        if row.family != "VOTE":
            continue
        for later in body[i:]:
            end = _branch_target(later)
            if end is not None and end > later.address:
                skipped |= {r.address for r in body if later.address < r.address < end}
                break
    return skipped


def interior_source(source: str) -> str:
    """The rendered kernel with every key tile taking the interior (no-test) path."""
    for test, interior in INTERIOR.items():
        if source.count(test) != 1:
            raise ValueError(f"the tensor-core template no longer contains {test!r} once")
        source = source.replace(test, interior)
    return source


def analyse(spec_path: Path, arch: str) -> dict[str, object]:
    from kernelgen.compile import compile_offline, disassemble
    from kernelgen.render import render
    from kernelgen.spec import load_spec

    spec = load_spec(spec_path)
    compiled = compile_offline(interior_source(render(spec)), spec.uri, arch, sass=False)
    sass = disassemble(compiled.cubin)
    if sass is None:
        raise RuntimeError("cuobjdump/nvdisasm are not installed (pip install '.[nvrtc]')")
    body = hmma_loop(sass)
    return {
        "spec": spec_path.stem,
        "arch": arch,
        "registers": compiled.resources.registers,
        "issued": body.issued,
        "per_hmma": round(body.per_hmma, 2),
        "rescale": body.rescale,
        "inner": body.inner_loops,
        **{name: body.counts.get(name, 0) for name in COLUMNS},
        "other": body.issued - sum(body.counts.get(name, 0) for name in COLUMNS),
    }


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.sass_loop", description=__doc__)
    parser.add_argument(
        "specs", nargs="*", type=Path, help="spec files (default: tensor-core specs)"
    )
    parser.add_argument("--arch", default="sm_90", help="target architecture (default sm_90)")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    paths = args.specs or sorted((ROOT / "specs").glob("v2_tc_*.yaml"))
    rows = [analyse(path, args.arch) for path in paths]
    header = ["spec", "regs", "issued", "per HMMA", *COLUMNS, "other", "rescale", "inner"]
    keys = ["spec", "registers", "issued", "per_hmma", *COLUMNS, "other", "rescale", "inner"]
    table = [[str(r[k]) for k in keys] for r in rows]
    print(f"Interior key-tile loop, one warp, {args.arch} (static SASS counts; issued: the path")
    print("where no row moves its reference m; rescale: the block a move adds; inner: loops")
    print("inside the body, whose repeats the count misses: 0 means the count is per tile)\n")
    print(md_table(header, table, align=["---"] + ["---:"] * (len(header) - 1)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
