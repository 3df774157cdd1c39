"""``python -m bench.dump_cubins``: the cubins a GPU host's own NVRTC makes of a few specs.

Static readings of the SASS (``kernelgen model``, the schedule check, bench/NOTES.md) are only
as good as the compiler they read: the H100 runs compiled with the host's NVRTC 13.2 while the
development machine had 13.5, and the two differ (issue 33's Q-in-registers loss showed in
13.2's SASS only). Each ``LABEL=SPEC.yaml[,FIELD=VALUE...]`` item (as ``bench.ncu_pair`` takes
them) is compiled offline for its arch and written as ``OUT/LABEL.cubin``, with
``OUT/versions.txt`` naming the NVRTC and each label's kernel; ``nvdisasm`` or ``cuobjdump
-sass`` reads them back on any machine. Needs NVRTC (cuda-bindings), not a GPU.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

from bench.profile_launch import build_items, items_parser


def main(argv: Sequence[str] | None = None) -> int:
    args = items_parser("python -m bench.dump_cubins", __doc__, "cubins").parse_args(argv)
    specs = build_items(args.items, "dump_cubins")
    if specs is None:
        return 2
    if args.dry_run:
        return 0
    from kernelgen.kernels.compile import compile_offline, nvrtc_version
    from kernelgen.kernels.render import render

    args.out.mkdir(parents=True, exist_ok=True)
    lines = [f"nvrtc {nvrtc_version()}"]
    for (label, _, _), spec in zip(args.items, specs, strict=True):
        arch = spec.archs[0]
        compiled = compile_offline(render(spec), spec.uri, arch, sass=False, report=False)
        tmp = args.out / f"{label}.cubin.tmp"
        tmp.write_bytes(compiled.cubin)
        os.replace(tmp, args.out / f"{label}.cubin")
        lines.append(f"{label} {spec.uri} {arch}")
    (args.out / "versions.txt").write_text("\n".join(lines) + "\n")
    print(lines[0])
    return 0


if __name__ == "__main__":
    sys.exit(main())
