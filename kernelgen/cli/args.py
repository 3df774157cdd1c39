"""Arguments the ``kernelgen`` commands share: spec files and ``--arch``."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated

import typer

from kernelgen.cli.console import fail
from kernelgen.errors import SpecError
from kernelgen.specs.arch import ARCHS

_ARCH_NAME = re.compile(r"^sm_\d+a?$")

SpecPaths = Annotated[list[Path], typer.Argument(help="Spec YAML files.", show_default=False)]
ArchOption = Annotated[
    list[str] | None,
    typer.Option(
        "--arch",
        help="Architectures to compile for (repeat, or list after it: --arch sm_80 sm_90). "
        "Default: each spec's archs.",
    ),
]


def split_archs(paths: list[Path], archs: list[str] | None) -> tuple[list[Path], list[str] | None]:
    """Let ``--arch sm_80 sm_90`` work: arch names among the paths join --arch; an unknown
    architecture is one line each and exit 2."""
    if archs is None:
        return paths, None
    extra = [p for p in paths if _ARCH_NAME.match(str(p)) and not p.exists()]
    names = [a for value in archs for a in value.replace(",", " ").split()]
    names += [str(p) for p in extra]
    unknown = [a for a in names if a not in ARCHS]
    if unknown:
        raise fail(
            [f"--arch {a}: unknown architecture; allowed: {', '.join(ARCHS)}" for a in unknown]
        )
    return [p for p in paths if p not in extra], names


def load_spec_files(paths: list[Path], archs: list[str] | None = None) -> list:
    """The specs of ``paths``; their problems are one line each and exit 2. With ``archs``
    (``--arch``), each spec must be able to target them exactly as if its YAML listed them (a
    wgmma spec on sm_80, shared memory over an arch's limit): an input error, not a failed
    compile."""
    from kernelgen.kernels.build import load_specs

    try:
        specs = load_specs(paths)
    except SpecError as exc:
        raise fail(exc.problems) from None
    if archs:
        problems = [
            f"{path}: --arch {' '.join(archs)}: {problem}"
            for path, spec in zip(paths, specs, strict=True)
            for problem in arch_problems(spec, archs)
        ]
        if problems:
            raise fail(problems)
    return specs


def arch_problems(spec, archs: list[str]) -> list[str]:
    """Why ``spec`` cannot target ``archs`` (empty: it can): the spec validator's own lines for
    the same spec with ``archs: archs``."""
    from kernelgen.families import spec_of_family

    try:
        spec_of_family({**spec.model_dump(), "archs": list(archs)})
    except SpecError as exc:
        return list(exc.problems)
    return []
