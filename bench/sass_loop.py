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

ROOT = Path(__file__).resolve().parent.parent
# What makes a key tile take the interior path in the tensor-core template, and what the interior
# variant writes instead: no key hidden and no mask (scores stay raw), and a full K/V tile to
# copy (no bounds test). Kept in sync by the check in interior_source().
INTERIOR = {
    "exact = tile >= first_exact || mask != nullptr;": "exact = false;",
    "if (key0 + BLOCK_N <= num_keys) {": "if (true) {",
}
COLUMNS = ("HMMA", "LDSM", "FMUL", "FFMA", "FADD", "FMNMX", "MUFU", "SHFL")
_INSTRUCTION = re.compile(
    r"^\s+/\*(?P<addr>[0-9a-f]{4,})\*/\s+(?P<pred>@!?U?P\w+\s+)?(?P<op>[A-Z][A-Z0-9_.]*)(?P<rest>[^;]*);",
    re.M,
)
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
    rows = [
        (int(m["addr"], 16), m["op"].split(".")[0], (m["pred"] or "").strip(), m["rest"])
        for m in _INSTRUCTION.finditer(sass)
        if (m["pred"] or "").strip() != "@!PT"
    ]
    best: LoopBody | None = None
    for addr, op, _, rest in rows:
        if not _is_backward(op, rest, addr):
            continue
        target = _TARGET.search(rest)
        assert target is not None
        body = [row for row in rows if int(target.group(1), 16) <= row[0] <= addr]
        skipped = _vote_skipped(body)
        counts = Counter(op for a, op, _, _ in body if a not in skipped)
        if counts["HMMA"] and (best is None or sum(counts.values()) > best.issued):
            inner = sum(_is_backward(op, rest, a) for a, op, _, rest in body[:-1])
            best = LoopBody(dict(counts), len(skipped), inner)
    if best is None:
        raise ValueError("no loop with HMMA instructions in the SASS")
    return best


def _is_backward(op: str, rest: str, addr: int) -> bool:
    target = _TARGET.search(rest) if op == "BRA" else None
    return target is not None and int(target.group(1), 16) < addr


def _vote_skipped(body: list[tuple[int, str, str, str]]) -> set[int]:
    """Addresses that the first forward branch after each VOTE.ANY jumps over."""
    skipped: set[int] = set()
    for i, (_, op, _, _) in enumerate(body):
        if op != "VOTE":
            continue
        for addr, later, _, rest in body[i:]:
            target = _TARGET.search(rest) if later == "BRA" else None
            if target and int(target.group(1), 16) > addr:
                end = int(target.group(1), 16)
                skipped |= {a for a, _, _, _ in body if addr < a < end}
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
