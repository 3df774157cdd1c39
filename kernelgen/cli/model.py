"""``kernelgen model``: the static performance model of tensor-core specs (no GPU needed)."""

from __future__ import annotations

import json
import sys
from typing import Annotated

import typer

from kernelgen.cli.args import ArchOption, SpecPaths, load_spec_files, split_archs
from kernelgen.cli.console import err_console, fail, out_console
from kernelgen.errors import KernelgenError


def model_reports(specs, archs: list[str] | None, built=None, shape=None) -> list:
    """A :class:`kernelgen.model.perfmodel.ModelReport` per tensor-core spec and modelled arch (the
    spec's archs, or ``archs``); other specs and archs are left out (:func:`unmodelled` says
    which). ``built`` (kernelgen build's BuiltKernel list) lends each kernel's ptxas resources,
    so it is not compiled again; ``shape`` (a :class:`kernelgen.model.perfmodel_shape.ProblemShape`)
    adds one call's predicted time to each report."""
    from kernelgen.model.perfmodel import RATES, model_spec
    from kernelgen.model.perfmodel_shape import model_with_shape

    resources = {(k.spec.uri, r.arch): r for k in built or [] for r in k.resources}

    def model(spec, arch):
        if shape is None:
            return model_spec(spec, arch, resources.get((spec.uri, arch)))
        return model_with_shape(spec, arch, shape, resources.get((spec.uri, arch)))

    try:
        return [
            model(spec, arch)
            for spec in specs
            if spec.engine.modelled
            for arch in (archs or spec.archs)
            if arch in RATES
        ]
    except KernelgenError as exc:
        raise fail([str(exc)]) from None


def unmodelled(specs, archs: list[str] | None) -> list[str]:
    """One line per spec, or spec and arch, that :func:`model_reports` leaves out, and why."""
    from kernelgen.model.perfmodel import RATES

    lines = []
    for spec in specs:
        if not spec.engine.modelled:
            lines.append(
                f"{spec.uri}: not modelled: the static model covers tensor-core specs only "
                "(mma: mma_sync or wgmma), not CUDA-core (simt) ones"
            )
            continue
        lines += [
            f"{spec.uri} {arch}: not modelled: the static model knows {', '.join(RATES)}"
            for arch in (archs or spec.archs)
            if arch not in RATES
        ]
    return lines


def register(app: typer.Typer) -> None:
    """Add ``kernelgen model`` to ``app``."""

    @app.command()
    def model(
        specs: SpecPaths,
        arch: ArchOption = None,
        as_json: Annotated[bool, typer.Option("--json", help="Print the reports as JSON.")] = False,
        shape: Annotated[
            str | None,
            typer.Option(
                "--shape",
                help="BATCH,HEADS,SEQLEN_Q,SEQLEN_K[,KV_HEADS]: also predict one call's time "
                "(grid fill, latency, HBM/L2 traffic; causal from the spec).",
            ),
        ] = None,
    ) -> None:
        """Per 64x64 unit of the steady-state key-tile loop (from the SASS): instructions by
        class, shared-memory traffic, the resource that binds and the predicted ceiling, also
        against FlashAttention 2's (docs/performance-model.md). Ratios, not times; with --shape
        also one call's predicted time on the arch's reference device."""
        from kernelgen.model.perfmodel_shape import ProblemShape

        try:
            problem = None if shape is None else ProblemShape.parse(shape)
        except KernelgenError as exc:
            raise fail([str(exc)]) from None
        paths, archs = split_archs(specs, arch)
        loaded = load_spec_files(paths, archs)
        skipped = unmodelled(loaded, archs)
        reports = model_reports(loaded, archs, shape=problem)
        if not reports:  # nothing to print: the user's input is the problem
            raise fail(skipped)
        for line in skipped:
            err_console.print(f"note: {line}", markup=False)
        if as_json:
            sys.stdout.write(json.dumps([r.as_dict() for r in reports], indent=2) + "\n")
            return
        for report in reports:
            out_console.print(f"{report.uri} {report.arch}", markup=False, highlight=False)
            out_console.print(f"  {report.summary()}", markup=False, highlight=False)
            if report.schedule:
                out_console.print(f"  schedule: {report.schedule}", markup=False, highlight=False)
            if report.shape is not None:
                out_console.print(f"  {report.shape.summary()}", markup=False, highlight=False)
