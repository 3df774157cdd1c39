"""``python -m bench.profile_launch``: a few launches of one spec, for a profiler to capture.

Nothing is timed or checked here: the launches exist so that Nsight Compute (or
compute-sanitizer) can record one of them, e.g. Q in registers against the plain loop::

    ncu --kernel-name regex:fa_fwd --launch-skip 2 --launch-count 1 --set full \\
        --import-source no -o OUT/qr python3 -m bench.profile_launch \\
        specs/v2_wg_bf16_d128_m128_n128_s2.yaml --set causal=true --set q_in_registers=true

The kernel's name is the spec's URI, printed on the last line. Inputs are torch ``randn`` in
the spec's dtype, (B, H, S, D) layout, keys as long as queries. Without a GPU it prints one line,
``bench: no usable GPU: ...``, and exits 2.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from kernelgen.errors import KernelgenError

FP8_DTYPES = ("float8_e4m3",)


def parse_override(text: str) -> tuple[str, Any]:
    """``field=value`` with the value read as YAML (``true``, ``128``, ``[sm_90a]``)."""
    name, sep, value = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"--set {text!r}: expected FIELD=VALUE")
    return name.strip(), yaml.safe_load(value)


def build_spec(path: Path, overrides: Sequence[tuple[str, Any]]) -> Any:
    from kernelgen.specs.forward import load_spec_data, spec_from_dict

    data = dict(load_spec_data(path))
    data.update(overrides)
    return spec_from_dict(data, str(path))


def parse_item(text: str) -> tuple[str, Path, list[str]]:
    """``LABEL=PATH[,FIELD=VALUE...]`` -> (label, path, the ``FIELD=VALUE`` texts, each checked
    by :func:`parse_override`, which reads them again): one spec of the tools that take several
    (``bench.ncu_pair``, ``bench.dump_cubins``)."""
    label, sep, rest = text.partition("=")
    if not sep or not label.isidentifier() or not rest:
        raise argparse.ArgumentTypeError(f"{text!r}: expected LABEL=SPEC.yaml[,FIELD=VALUE...]")
    path, *overrides = rest.split(",")
    for override in overrides:
        parse_override(override)
    return label, Path(path), overrides


def items_parser(prog: str, description: str | None, out: str) -> argparse.ArgumentParser:
    """The command line of a tool that takes ``LABEL=SPEC[,F=V...]`` items, ``--out`` (default
    ``out``) and ``--dry-run`` (build the specs only)."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("items", nargs="+", type=parse_item, metavar="LABEL=SPEC[,F=V...]")
    parser.add_argument("--out", type=Path, default=Path(out))
    parser.add_argument("--dry-run", action="store_true", help="build the specs only")
    return parser


def build_items(items: Sequence[tuple[str, Path, list[str]]], tool: str) -> list[Any] | None:
    """The specs of parsed items, each label printed with its kernel; None (after one line on
    stderr naming ``tool``) when one is not a valid spec or its file cannot be read."""
    try:
        specs = [build_spec(path, [parse_override(x) for x in overrides])
                 for _, path, overrides in items]  # fmt: skip
    except (KernelgenError, OSError) as exc:
        print(f"{tool}: {str(exc).splitlines()[0]}", file=sys.stderr)
        return None
    for (label, _, _), spec in zip(items, specs, strict=True):
        print(f"{label}: {spec.uri} ({', '.join(spec.archs)})")
    return specs


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.profile_launch", description=__doc__)
    parser.add_argument("spec", type=Path, help="a forward spec YAML file")
    parser.add_argument(
        "--set", dest="overrides", action="append", default=[], type=parse_override,
        metavar="FIELD=VALUE", help="override a spec field (repeatable)",
    )  # fmt: skip
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--seqlen", type=int, default=4096)
    parser.add_argument("--calls", type=int, default=3, help="launches (default 3)")
    args = parser.parse_args(argv)
    for name in ("batch", "heads", "seqlen", "calls"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    try:
        spec = build_spec(args.spec, args.overrides)
    except (KernelgenError, OSError) as exc:
        print(f"bench: {str(exc).splitlines()[0]}", file=sys.stderr)
        return 2
    if spec.dtype in FP8_DTYPES:
        print(f"bench: {spec.uri}: fp8 specs need descales; profile them through bench.attention's "
              "kg-wgmma-fp8 peer", file=sys.stderr)  # fmt: skip
        return 2
    try:
        import torch

        if not torch.cuda.is_available():
            raise RuntimeError("torch sees no CUDA device")
    except (ImportError, RuntimeError) as exc:
        print(f"bench: no usable GPU: {str(exc).splitlines()[0]}", file=sys.stderr)
        return 2
    import kernelgen

    generator = torch.Generator(device="cuda").manual_seed(0)
    shape = (args.batch, args.heads, args.seqlen, spec.head_dim)
    dtype = getattr(torch, spec.dtype)
    q, k, v = (torch.randn(shape, device="cuda", generator=generator).to(dtype) for _ in range(3))
    for _ in range(args.calls):
        kernelgen.attention(q, k, v, causal=spec.causal, spec=spec)
    torch.cuda.synchronize()
    print(spec.uri)
    return 0


if __name__ == "__main__":
    sys.exit(main())
