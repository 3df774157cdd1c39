"""The ``kernelgen`` command: build, show, check, schema.

Problems with specs or tools print one line each and exit 2, never a traceback.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich import box
from rich.table import Table

from kernelgen.cli.args import ArchOption, SpecPaths, load_spec_files, split_archs
from kernelgen.cli.console import err_console, fail, out_console, plural
from kernelgen.cli.emulate import register as register_emulate
from kernelgen.cli.model import register as register_model
from kernelgen.cli.tune import register as register_tuning
from kernelgen.errors import CompileError, KernelgenError
from kernelgen.specs.arch import ARCHS
from kernelgen.specs.forward import spec_json_schema

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="Generate specialized FlashAttention CUDA kernels from tiling specs.",
)


def _print_version(value: bool) -> None:
    if value:
        from kernelgen import __version__

        out_console.print(f"kernelgen {__version__}", markup=False, highlight=False)
        raise typer.Exit(0)


@app.callback()
def _root(
    version: Annotated[
        bool,
        typer.Option(
            "--version", callback=_print_version, is_eager=True, help="Print the version and exit."
        ),
    ] = False,
) -> None:
    """Generate specialized FlashAttention CUDA kernels from tiling specs."""


def _summary_table(built) -> Table:
    """One row per kernel, values per arch joined by '/', narrow enough for 80 columns."""
    archs = "/".join(r.arch.removeprefix("sm_") for r in built[0].resources) if built else ""
    table = Table(
        title=f"kernelgen build (per arch: sm_{archs}; local = spill + stack bytes)",
        box=box.SIMPLE_HEAD,
        pad_edge=False,
        collapse_padding=True,
    )
    # Numbers never shrink; a kernel name longer than the terminal allows folds onto a second line.
    table.add_column("kernel", overflow="fold")
    for column, width in (("regs", 7), ("local", 5), ("smem", 6)):
        table.add_column(column, justify="right", no_wrap=True, min_width=width)
    for kernel in built:
        res = kernel.resources
        table.add_row(
            kernel.spec.uri,
            "/".join(str(r.registers) for r in res),
            "/".join(str(r.spill_store_bytes + r.spill_load_bytes + r.stack_bytes) for r in res),
            str(kernel.spec.smem_bytes + max(r.static_smem_bytes for r in res)),
        )
    return table


def _print_resources(built) -> None:
    """Per kernel, one line per arch (registers, spill/stack/shared bytes against the arch's
    limit, resident blocks per SM) and its SASS opcode counts, local memory shown even at 0
    (`kernelgen check`)."""
    from kernelgen.kernels.build import SASS_SHOWN
    from kernelgen.runtime.occupancy import kernel_occupancy

    for kernel in built:
        out_console.print(kernel.spec.uri, markup=False, highlight=False)
        for r in kernel.resources:
            smem = kernel.spec.smem_bytes + r.static_smem_bytes
            resident = kernel_occupancy(kernel.spec, r.arch, r)
            out_console.print(
                f"  {r.arch}: {r.registers} registers, "
                f"spill {r.spill_store_bytes + r.spill_load_bytes} B, stack {r.stack_bytes} B, "
                f"shared {smem} of {ARCHS[r.arch].max_smem_per_block} B, "
                f"{plural(resident.blocks, 'block')}/SM ({resident.limiter})",
                markup=False,
                highlight=False,
            )
            counts = r.sass_instructions
            shown = [f"{k}={counts.get(k, 0)}" for k in SASS_SHOWN]
            shown += [f"{k}={v}" for k, v in counts.items() if v and k not in SASS_SHOWN]
            sass = ", ".join(shown) if counts else "not disassembled (no cuobjdump)"
            out_console.print(f"    SASS: {sass}", markup=False, highlight=False)


def _compile(specs, archs):
    """Compile with a progress bar on stderr (a terminal only: logs stay clean)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    from kernelgen.kernels.build import build_kernels

    total = sum(len(archs or spec.archs) for spec in specs)
    progress = Progress(
        TextColumn("compiling"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.description}"),
        console=err_console,
        transient=True,
        disable=not err_console.is_terminal,
    )
    try:
        with progress:
            task = progress.add_task("", total=total)
            return build_kernels(
                specs, archs, lambda what: progress.update(task, advance=1, description=what)
            )
    except CompileError as exc:
        raise fail([str(exc)], 1) from None
    except KernelgenError as exc:
        raise fail([str(exc)]) from None


def _check_out_dir(out: Path) -> None:
    """Exit 2 in one line when ``out`` (or a parent) exists and is not a folder."""
    for folder in (out, *out.parents):
        if folder.exists():
            if not folder.is_dir():
                raise fail([f"-o {out}: {folder} exists and is not a folder"])
            return


def specs_left_out(paths: list[Path]) -> list[Path]:
    """The spec files (``*.yaml``, ``*.yml``) in the folders of ``paths`` that ``paths`` does
    not name: empty when the given specs are their folders' whole set."""
    given = {path.resolve() for path in paths}
    folders = {path.resolve().parent for path in paths}
    return sorted(
        spec
        for folder in folders
        for pattern in ("*.yaml", "*.yml")
        for spec in folder.glob(pattern)
        if spec.resolve() not in given
    )


def _check_generated(paths: list[Path], loaded, out: Path) -> None:
    """``build --check``: exit 1, one line per problem, when ``out`` does not match the specs;
    orphaned files count only when the specs are their folders' whole set."""
    from kernelgen.kernels.build import stale_files

    left_out = specs_left_out(paths)
    problems = stale_files(loaded, out, orphans=not left_out)
    if problems:
        raise fail([*problems, "run `kernelgen build` on the same specs to refresh"], 1)
    out_console.print(f"{out}/ is up to date with {plural(len(loaded), 'spec')}", markup=False)
    if left_out:
        out_console.print(
            f"orphaned files not checked: {plural(len(left_out), 'other spec')} in the same "
            "folders were not given (give them all, e.g. specs/*.yaml, to check for orphans)",
            markup=False,
            highlight=False,
        )


@app.command()
def build(
    specs: SpecPaths,
    out: Annotated[Path, typer.Option("-o", "--out", help="Output folder.")] = Path("generated"),
    arch: ArchOption = None,
    check: Annotated[
        bool, typer.Option("--check", help="Only check that the output folder is up to date.")
    ] = False,
) -> None:
    """Render, compile offline and write OUT/<uri>.cu plus OUT/manifest.json.

    A kernel that fails the static bar of `kernelgen check` (spills, a stack, local memory,
    shared memory over the limit, a tensor-core spec without HMMA/LDSM) is still written, with
    one "warning:" line on stderr per problem, and build exits 0: build makes sources, check
    judges them (it exits 1 on the same kernels).

    --check looks for orphaned .cu files (no given spec produces them) only when every spec of
    the given specs' folders is given; with a subset it checks that subset's files and says
    that orphans were not checked."""
    from kernelgen.kernels.build import static_problems, write_generated

    paths, archs = split_archs(specs, arch)
    loaded = load_spec_files(paths, archs)
    _check_out_dir(out)  # before compiling anything
    if check:
        _check_generated(paths, loaded, out)
        return
    built = _compile(loaded, archs)
    try:
        notes = write_generated(built, out)
    except OSError as exc:  # e.g. a read-only folder
        raise fail([f"cannot write to {out}: {exc.strerror or exc}"]) from None
    for note in notes:
        err_console.print(f"warning: {note}", markup=False, highlight=False)
    out_console.print(_summary_table(built))
    out_console.print(f"wrote {plural(len(built), 'kernel')} and {out / 'manifest.json'}")
    for k in built:
        for r in k.resources:
            for why in static_problems(k.spec, r):
                err_console.print(
                    f"warning: {k.spec.uri}: {why} (kernelgen check exits 1 on it)", markup=False
                )


@app.command()
def show(spec: Annotated[Path, typer.Argument(help="A spec YAML file.")]) -> None:
    """Print the CUDA source a spec generates."""
    from kernelgen.families import render_any

    (loaded,) = load_spec_files([spec])
    sys.stdout.write(render_any(loaded))


@app.command()
def check(
    specs: SpecPaths,
    arch: ArchOption = None,
    model: Annotated[
        bool, typer.Option("--model", help="Also print the static performance model's line.")
    ] = False,
) -> None:
    """Compile specs offline and print registers, spills, stack, shared memory and SASS facts;
    exit 1, one line per problem, when a kernel spills, uses a stack or local memory, exceeds
    its arch's shared memory, or is a tensor-core spec without HMMA/LDSM in its SASS."""
    from kernelgen.cli.model import model_reports
    from kernelgen.kernels.build import static_problems

    paths, archs = split_archs(specs, arch)
    loaded = load_spec_files(paths, archs)
    built = _compile(loaded, archs)
    _print_resources(built)
    if model:
        for report in model_reports(loaded, archs, built):
            out_console.print(f"{report.uri} {report.arch}: {report.summary()}", markup=False)
    problems = [
        f"{k.spec.uri}: {why}"
        for k in built
        for r in k.resources
        for why in static_problems(k.spec, r)
    ]
    if problems:
        raise fail(problems, 1)


@app.command()
def schema() -> None:
    """Print the JSON Schema of spec files (for editor validation)."""
    sys.stdout.write(json.dumps(spec_json_schema(), indent=2) + "\n")


register_tuning(app)  # kernelgen tune, kernelgen cache ...
register_model(app)  # kernelgen model
register_emulate(app)  # kernelgen emulate


def main() -> None:
    try:
        app()
    except KernelgenError as exc:  # one a command did not catch, e.g. a bad KERNELGEN_TEMPLATE_DIR
        err_console.print(str(exc), markup=False)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
