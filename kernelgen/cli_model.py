"""``kernelgen model``: the static performance model of tensor-core specs (no GPU needed)."""

import json
import sys
from pathlib import Path
from typing import Annotated

import typer

from kernelgen.arch import ARCHS
from kernelgen.cli_console import err_console, out_console
from kernelgen.errors import KernelgenError, SpecError


def model_reports(specs, archs: list[str] | None) -> list:
    """A :class:`kernelgen.perfmodel.ModelReport` per mma_sync spec and modelled arch (the
    spec's archs, or ``archs``); other specs and archs are left out."""
    from kernelgen.perfmodel import RATES, model_spec

    return [
        model_spec(spec, arch)
        for spec in specs
        if spec.mma == "mma_sync"
        for arch in (archs or spec.archs)
        if arch in RATES
    ]


def _exit(lines: list[str]) -> typer.Exit:
    for line in lines:
        err_console.print(line, markup=False)
    return typer.Exit(2)


def register(app: typer.Typer) -> None:
    """Add ``kernelgen model`` to ``app``."""

    @app.command()
    def model(
        specs: Annotated[list[Path], typer.Argument(help="Spec YAML files.", show_default=False)],
        arch: Annotated[
            list[str] | None,
            typer.Option(
                "--arch",
                help="Architectures (repeat --arch, or comma-separated); default: the spec's.",
            ),
        ] = None,
        as_json: Annotated[bool, typer.Option("--json", help="Print the reports as JSON.")] = False,
    ) -> None:
        """Per 64x64 unit of the steady-state key-tile loop (from the SASS): instructions by
        class, shared-memory traffic, the resource that binds and the predicted ceiling, also
        against FlashAttention 2's (docs/performance-model.md). Ratios, not times."""
        from kernelgen.build import load_specs

        names = [a for value in arch or [] for a in value.replace(",", " ").split()]
        unknown = [f"--arch {a}: unknown architecture; allowed: {', '.join(ARCHS)}" for a in names
                   if a not in ARCHS]  # fmt: skip
        if unknown:
            raise _exit(unknown)
        try:
            reports = model_reports(load_specs(specs), names or None)
        except SpecError as exc:
            raise _exit(exc.problems) from None
        except KernelgenError as exc:
            raise _exit([str(exc)]) from None
        if as_json:
            sys.stdout.write(json.dumps([r.as_dict() for r in reports], indent=2) + "\n")
            return
        for report in reports:
            out_console.print(f"{report.uri} {report.arch}", markup=False, highlight=False)
            out_console.print(f"  {report.summary()}", markup=False, highlight=False)
