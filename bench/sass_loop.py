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
import sys
from collections.abc import Sequence
from pathlib import Path

from bench.report import md_table
from kernelgen.model.perfmodel import interior_loop

ROOT = Path(__file__).resolve().parent.parent
COLUMNS = ("HMMA", "LDSM", "FMUL", "FFMA", "FADD", "FMNMX", "MUFU", "SHFL", "BAR")


def analyse(spec_path: Path, arch: str) -> dict[str, object]:
    from kernelgen.kernels.compile import compile_offline
    from kernelgen.kernels.render import render
    from kernelgen.specs.forward import load_spec

    spec = load_spec(spec_path)
    body = interior_loop(spec, arch)
    registers = compile_offline(render(spec), spec.uri, arch, sass=False).resources.registers
    return {
        "spec": spec_path.stem,
        "arch": arch,
        "registers": registers,  # the real kernel's, not the interior variant's
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
