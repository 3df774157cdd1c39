"""``kernelgen model``: the static performance model of tensor-core specs (no GPU needed)."""

import json
import sys
from typing import Annotated

import typer

from kernelgen.errors import KernelgenError


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


def register(app: typer.Typer) -> None:
    """Add ``kernelgen model`` to ``app``."""
    from kernelgen import cli

    @app.command()
    def model(
        specs: cli.SpecPaths,
        arch: cli.ArchOption = None,
        as_json: Annotated[bool, typer.Option("--json", help="Print the reports as JSON.")] = False,
    ) -> None:
        """Per 64x64 unit of the steady-state key-tile loop (from the SASS): instructions by
        class, shared-memory traffic, the resource that binds and the predicted ceiling, also
        against FlashAttention 2's (docs/performance-model.md). Ratios, not times."""
        paths, archs = cli._split_archs(specs, arch)
        loaded = cli._load(paths)
        try:
            reports = model_reports(loaded, archs)
        except KernelgenError as exc:
            raise cli._fail([str(exc)]) from None
        if as_json:
            sys.stdout.write(json.dumps([r.as_dict() for r in reports], indent=2) + "\n")
            return
        for report in reports:
            cli.out_console.print(f"{report.uri} {report.arch}", markup=False, highlight=False)
            cli.out_console.print(f"  {report.summary()}", markup=False, highlight=False)
