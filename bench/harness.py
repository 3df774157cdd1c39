"""The benchmarks' shared harness: budgets, the run's provenance (git), the GPU environment, the
loop over shapes with checkpoints, and :class:`Harness`, which checks, measures memory and times
one implementation on one shape. ``bench.attention`` (prefill) and ``bench.decode`` build on it;
neither imports the other's internals.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from bench import metrics, report

ROOT = Path(__file__).resolve().parent.parent
QUICK_BUDGET_MS = 200.0
FULL_BUDGET_MS = 500.0
GIB = 1 << 30


def git_info(root: Path = ROOT) -> dict[str, Any]:
    """Commit of the working tree and whether it has uncommitted changes ("unknown" if no git).
    Under ``python -m bench.session`` the session's stamp check says it (the environment's
    KERNELGEN_SESSION_COMMIT / _DIRTY): a GPU host's copy may carry stale git metadata."""
    if os.environ.get("KERNELGEN_SESSION_COMMIT"):
        dirty = os.environ.get("KERNELGEN_SESSION_DIRTY", "")
        return {"git_commit": os.environ["KERNELGEN_SESSION_COMMIT"], "git_dirty": dirty == "1"}
    try:
        top = subprocess.run(
            ["git", "rev-parse", "--show-toplevel"],
            cwd=root,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        if Path(top).resolve() != root.resolve():  # a copy inside some other repository
            return {"git_commit": "unknown", "git_dirty": None}
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain"], cwd=root, capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return {"git_commit": "unknown", "git_dirty": None}
    return {"git_commit": commit or "unknown", "git_dirty": bool(dirty)}


class Harness:
    """Check, memory and timing of one implementation on one shape (``measure``, ``guarded``,
    ``compiled``); a benchmark's runner adds its peers, ``figures`` and ``shape_rows``."""

    def __init__(
        self, env: Any, args: argparse.Namespace, floors: dict[str, Any], peers: list[str]
    ) -> None:
        from bench import gpu

        self.gpu, self.env, self.args, self.floors = gpu, env, args, floors
        self.peers = peers
        budget = args.budget_ms or (QUICK_BUDGET_MS if args.quick else FULL_BUDGET_MS)
        self.timer = gpu.Timer(env, budget, min_reps=args.min_reps)
        self.compile_s: dict[str, float] = {}

    def figures(self, shape: Any, times: list[float]) -> dict[str, Any]:
        """The figures of a row from its per-call times (ms)."""
        raise NotImplementedError

    def shape_rows(self, shape: Any) -> list[dict[str, Any]]:
        """Every selected peer on one shape."""
        raise NotImplementedError

    def measure(
        self, shape: Any, impl: Any, sets: list, ref: Any, budget_ms: float | None = None
    ) -> tuple[str, dict[str, Any]]:
        """(status, fields) of one implementation: check, memory, then timing."""
        gpu, env = self.gpu, self.env
        q, k, v = sets[0]
        out_bytes = metrics.tensor_bytes(shape)["out"]
        tol = metrics.tolerance(shape.dtype)
        if impl.poison is not None:
            with impl.poison():
                out = impl.call(q, k, v)
        else:
            gpu.poison_allocators(env, out_bytes)
            out = impl.call(q, k, v)
        env.sync()
        err, nonfinite = gpu.relative_error(env, out, ref)
        del out
        fields: dict[str, Any] = {"rel_err": err, "tol": tol, "nonfinite": nonfinite}
        if impl.spec_uri:
            fields["spec_uri"] = impl.spec_uri
        if err is None or err >= tol:
            why = f"{nonfinite} non-finite outputs" if err is None else f"rel. error {err:.3g}"
            return report.WRONG, {**fields, "reason": f"{why} >= tolerance {tol:g}"}
        extra = gpu.extra_memory(env, impl, q, k, v, out_bytes)
        fields["extra_mem_bytes"] = extra
        fields["extra_mem_limit_bytes"] = metrics.lse_bytes(shape)
        fields["extra_mem_ok"] = extra <= metrics.lse_bytes(shape)
        times, info = self.timer.measure(
            lambda i: impl.call(*sets[i]), len(sets), budget_ms=budget_ms
        )
        fields.update(self.figures(shape, times))
        fields["timing"] = info
        return report.OK, fields

    def guarded(self, shape: Any, peer: str, make: Any, sets: list, ref: Any) -> dict[str, Any]:
        """Build and measure one peer; any failure becomes an error row, not a crash."""
        gpu = self.gpu
        try:
            impl = make()
            status, fields = self.measure(shape, impl, sets, ref)
        except gpu.FatalGPUError:
            raise
        except Exception as exc:
            self.env.sync()  # raises FatalGPUError when the context is gone
            status = report.UNAVAILABLE if type(exc).__name__ == "SpecError" else report.ERROR
            return report.make_row(shape, peer, status, reason=gpu.first_line(exc))
        return report.make_row(shape, peer, status, **fields)

    def compiled(self, spec: Any) -> None:
        if spec.uri not in self.compile_s:
            self.compile_s[spec.uri] = self.gpu.compile_spec(self.env, spec)


# ---- the run -----------------------------------------------------------------------------------
def open_env() -> Any:
    """The GPU environment (bench.gpu.open_gpu), or None after one line on stderr."""
    from bench import gpu

    try:
        return gpu.open_gpu()
    except gpu.NoGPUError as exc:
        print(f"bench: no usable GPU: {exc}", file=sys.stderr)
        return None


def run_settings(args: argparse.Namespace, shapes: Sequence[Any], **extra: Any) -> dict:
    """The settings block of a result file: the flags, tolerances, ``extra``, the shape keys."""
    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    settings.update(tolerance=metrics.TOLERANCE, **extra, shapes=[s.key for s in shapes])
    return settings


def run_shapes(
    shapes: Sequence[Any],
    rows_of: Callable[[Any], list[dict[str, Any]]],
    checkpoint: Callable[[list[dict[str, Any]]], None],
) -> tuple[list[dict[str, Any]], str | None]:
    """``rows_of`` each shape in turn, ``checkpoint`` after each; stops at a dead GPU context.

    Returns (rows, why it stopped or None)."""
    from bench import gpu

    rows: list[dict[str, Any]] = []
    for shape in shapes:
        try:
            rows += rows_of(shape)
        except gpu.FatalGPUError as exc:
            print(f"bench: stopping: {exc}", file=sys.stderr)
            return rows, str(exc)
        checkpoint(rows)
    return rows, None


def shape_or_error(runner: Harness, shape: Any) -> list[dict[str, Any]]:
    """The shape's rows, or one ``all`` error row when it fails (e.g. out of memory while
    making inputs). FatalGPUError passes through."""
    gpu = runner.gpu
    try:
        return runner.shape_rows(shape)
    except gpu.FatalGPUError:
        raise
    except Exception as exc:
        print(f"bench: shape {shape.key} failed: {gpu.first_line(exc)}", file=sys.stderr)
        gpu.release(runner.env)
        return [report.make_row(shape, "all", report.ERROR, reason=gpu.first_line(exc))]


def load_previous(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return list(json.loads(path.read_text()).get("rows", []))
