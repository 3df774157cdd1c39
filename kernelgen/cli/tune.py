"""``kernelgen tune`` and ``kernelgen cache ...``: register them with :func:`register`.

Problems print one line each on stderr and exit 2, never a traceback.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich import box
from rich.table import Table

from kernelgen.cli.console import fail, out_console, plural
from kernelgen.errors import KernelgenError
from kernelgen.tuning.db import TuningDB
from kernelgen.tuning.key import DeviceInfo, ProblemDesc, SoftwareInfo

cache_app = typer.Typer(no_args_is_help=True, help="Inspect and move tuning records.")

# What a dry run assumes without a GPU (an H100 SXM) unless --arch / --sms say otherwise.
DRY_RUN_DEVICE = DeviceInfo("(assumed) NVIDIA H100", "9.0", 132)
# --arch: a reference device per architecture and its SM count (--sms overrides it).
DRY_RUN_DEVICES: dict[str, tuple[str, int]] = {
    "sm_80": ("NVIDIA A100", 108),
    "sm_86": ("NVIDIA A40", 84),
    "sm_89": ("NVIDIA L40S", 142),
    "sm_90": ("NVIDIA H100", 132),
    "sm_90a": ("NVIDIA H100", 132),
    "sm_100": ("NVIDIA B200", 148),
    "sm_120": ("NVIDIA RTX 5090", 170),
}


def current_environment() -> tuple[DeviceInfo, SoftwareInfo]:
    """This machine's GPU and toolchain (raises ToolchainMissingError without them)."""
    from kernelgen.tuning.gpu import detect_device, detect_software

    return detect_device(), detect_software()


def _dry_run_device(arch: str | None, sms: int | None) -> DeviceInfo:
    if arch is None:
        try:
            device = current_environment()[0]
        except KernelgenError:
            device = DRY_RUN_DEVICE
    else:
        device = assumed_device(arch)
    if sms is not None:
        if sms < 1:
            raise fail([f"--sms {sms}: the SM count must be at least 1"])
        device = DeviceInfo(device.name, device.compute_capability, sms, device.l2_bytes)
    return device


def assumed_device(arch: str) -> DeviceInfo:
    """The device a dry run with ``--arch`` assumes: the arch's reference device of
    :data:`DRY_RUN_DEVICES` (an unknown arch is one line, exit 2)."""
    from kernelgen.specs.arch import ARCHS

    if arch not in DRY_RUN_DEVICES:
        raise fail([f"--arch {arch}: unknown architecture; allowed: {', '.join(ARCHS)}"])
    name, sm_count = DRY_RUN_DEVICES[arch]
    capability = ARCHS[arch].compute_capability
    return DeviceInfo(f"(assumed) {name}", f"{capability // 10}.{capability % 10}", sm_count)


def _dry_run(problem: ProblemDesc, device: DeviceInfo) -> None:
    from kernelgen.model.perfmodel import analytic_cost
    from kernelgen.runtime.occupancy import kernel_occupancy
    from kernelgen.tuning.candidates import modelled, prune

    kept, dropped = prune(problem, device)
    out_console.print(
        f"problem bucket {problem.bucket().label} on {device.name} "
        f"({device.target_arch}, {device.sm_count} SMs; --arch/--sms to change)",
        markup=False,
    )
    unchecked = any(c.resources is None for c in kept)
    if unchecked:
        out_console.print(
            "resources not checked: no offline NVRTC (pip install 'kernelgen[nvrtc]'), so "
            "these candidates were not compiled and may spill or use a stack",
            markup=False,
            highlight=False,
        )
    title = "candidates to time" + (" (registers and spills unchecked)" if unchecked else "")
    table = Table(title=title, box=box.SIMPLE_HEAD, pad_edge=False)
    table.add_column("candidate", no_wrap=True)
    table.add_column("splits", justify="right")
    table.add_column("regs", justify="right")
    table.add_column("smem", justify="right")
    table.add_column("blocks/SM", justify="right")  # resident blocks, and what limits them
    table.add_column("model", justify="right")  # predicted clocks per 64x64 unit (rank order)
    for c in kept:
        regs = str(c.resources.registers) if c.resources else "unchecked"
        splits = str(c.num_splits) if c.num_splits else "-"
        occupancy = kernel_occupancy(c.spec, device.target_arch, c.resources)
        short = {"registers": "regs", "shared memory": "smem"}.get(occupancy.limiter)
        blocks = f"{occupancy.blocks} {short or occupancy.limiter}"
        ranked = modelled(c.spec)  # as prune_by_model
        model = f"{analytic_cost(c.spec, device.target_arch):.0f}" if ranked else "-"
        table.add_row(c.spec.uri, splits, regs, str(c.spec.smem_bytes), blocks, model)
    out_console.print(table)
    for d in dropped:
        out_console.print(f"drop [{d.stage}] {d.uri}: {d.reason}", markup=False, highlight=False)
    out_console.print(f"{len(kept)} to time, {len(dropped)} dropped (dry run: nothing timed)")


def tune(
    shape: Annotated[str, typer.Option("--shape", help="B,H,HKV,SQ,SK,D")],
    dtype: Annotated[str, typer.Option("--dtype", help="bf16, fp16, fp32 or e4m3 (fp8)")] = "bf16",
    causal: Annotated[bool, typer.Option("--causal", help="Causal (bottom-right).")] = False,
    mask: Annotated[bool, typer.Option("--mask", help="With an additive mask.")] = False,
    backward: Annotated[
        bool, typer.Option("--backward", help="The backward pass (attention_backward).")
    ] = False,
    deterministic: Annotated[
        bool, typer.Option("--deterministic", help="Backward: dQ without atomics.")
    ] = False,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Show candidates and drop reasons; time nothing.")
    ] = False,
    arch: Annotated[
        str | None, typer.Option("--arch", help="Dry run: assume this arch (e.g. sm_90).")
    ] = None,
    sms: Annotated[int | None, typer.Option("--sms", help="Dry run: assume this SM count.")] = None,
    force: Annotated[bool, typer.Option("--force", help="Re-tune even if recorded.")] = False,
) -> None:
    """Tune one problem shape on this GPU and record the winner (or --dry-run: no GPU needed);
    --backward tunes its backward pass."""
    try:
        if deterministic and not backward:
            raise fail(["--deterministic is a backward option; add --backward"])
        family = "backward" if backward else "forward"
        problem = ProblemDesc.from_shape(
            shape, dtype, causal, mask, family=family, deterministic=deterministic
        )
        if dry_run:
            _dry_run(problem, _dry_run_device(arch, sms))
            return
        from kernelgen.tuning.autotune import select_launch

        device, software = current_environment()
        launch = select_launch(problem, device, software=software, mode="on", force=force)
    except KernelgenError as exc:
        raise fail(str(exc).splitlines()[:1]) from None
    out_console.print(f"{problem.bucket().label}: {launch.label}", markup=False)


@cache_app.command("list")
def cache_list() -> None:
    """One line per record: key, winner, time."""
    db = TuningDB()
    # the title on a line of its own: a table title wraps at the table's width, a long path too
    out_console.print(f"tuning records in {db.dir}", markup=False, highlight=False, soft_wrap=True)
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False)
    for column in ("key", "device", "winner", "ms"):
        table.add_column(column, overflow="fold")
    for path, record in db.records():
        if record is None:
            table.add_row(path.stem, "", "(unreadable)", "")
            continue
        ms = record.winner_ms
        winners = (c.get("uri") for c in record.candidates if c.get("status") == "winner")
        winner = str(next(winners, "?"))
        if record.winner_splits:
            winner += f" ({record.winner_splits} splits)"
        timing = f"{ms:.4f}" if isinstance(ms, float | int) and ms else "?"
        table.add_row(path.stem, record.key.device.name, winner, timing)
    out_console.print(table)


@cache_app.command("show")
def cache_show(key: Annotated[str, typer.Argument(help="A key id (or a unique prefix).")]) -> None:
    """Print one record as JSON."""
    db = TuningDB()
    try:
        path = db.find(key)
    except KeyError as exc:
        raise fail([exc.args[0]]) from None
    record = db.read_path(path)
    if record is None:
        raise fail([f"{path} is unreadable or corrupt"])
    out_console.print_json(json.dumps(record.payload()))


@cache_app.command("clear")
def cache_clear() -> None:
    """Remove every tuning record."""
    db = TuningDB()
    try:
        removed = db.clear()
    except OSError as exc:
        raise fail([f"cannot clear {db.dir}: {exc.strerror or exc}"]) from None
    out_console.print(f"removed {plural(removed, 'record')} from {db.dir}")


@cache_app.command("export")
def cache_export(file: Annotated[Path, typer.Argument(help="Bundle to write (JSON).")]) -> None:
    """Write every record to one file, for `kernelgen cache import` on a like machine."""
    try:
        count = TuningDB().export(file)
    except OSError as exc:
        raise fail([f"cannot write {file}: {exc.strerror or exc}"]) from None
    out_console.print(f"exported {plural(count, 'record')} to {file}")


@cache_app.command("import")
def cache_import(file: Annotated[Path, typer.Argument(help="A bundle from cache export.")]) -> None:
    """Store a bundle's records whose device and software match this machine."""
    from kernelgen.tuning.autotune import clear_memo
    from kernelgen.tuning.key import environment_id

    db = TuningDB()
    try:
        records = db.read_bundle(file)  # a bad file is reported before the GPU is looked at
        imported, rejected = db.import_records(records, environment_id(*current_environment()))
    except (KernelgenError, ValueError) as exc:
        raise fail(str(exc).splitlines()[:1]) from None
    except OSError as exc:
        raise fail([f"cannot write to {db.dir}: {exc.strerror or exc}"]) from None
    clear_memo()
    out_console.print(f"imported {plural(imported, 'record')} into {db.dir}")
    if rejected:
        raise fail(rejected)


def register(app: typer.Typer) -> None:
    """Add ``tune`` and the ``cache`` group to the ``kernelgen`` command."""
    app.command("tune")(tune)
    app.add_typer(cache_app, name="cache")
