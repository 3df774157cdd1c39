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
from bench.session import COMMIT_ENV, DIRTY_ENV

ROOT = Path(__file__).resolve().parent.parent
QUICK_BUDGET_MS = 200.0
FULL_BUDGET_MS = 500.0
GIB = 1 << 30


def git_info(root: Path = ROOT) -> dict[str, Any]:
    """Commit of the working tree and whether it has uncommitted changes ("unknown" if no git).
    Under ``python -m bench.session`` the session's stamp check says it (the environment's
    KERNELGEN_SESSION_COMMIT / _DIRTY): a GPU host's copy may carry stale git metadata."""
    if os.environ.get(COMMIT_ENV):
        return {"git_commit": os.environ[COMMIT_ENV], "git_dirty": os.environ.get(DIRTY_ENV) == "1"}
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


# What nvidia-smi is asked at the start and end of a run: current and maximum clocks (MHz), the
# temperature, the power draw and the active clock-throttle reasons (a bit mask).
CLOCK_QUERY = (
    "clocks.sm",
    "clocks.mem",
    "clocks.max.sm",
    "clocks.max.mem",
    "temperature.gpu",
    "power.draw",
    "clocks_throttle_reasons.active",
)


def parse_clocks(text: str, query: Sequence[str] = CLOCK_QUERY) -> dict[str, Any] | None:
    """The first GPU's line of ``nvidia-smi --query-gpu=... --format=csv,noheader,nounits``
    as {field: number or text}; None when there is no line of the expected width. Values
    nvidia-smi cannot read (``[N/A]``, ``[Not Supported]``) become None."""
    lines = [line for line in text.splitlines() if line.strip()]
    if not lines:
        return None
    cells = [c.strip() for c in lines[0].split(",")]
    if len(cells) != len(query):
        return None
    out: dict[str, Any] = {}
    for name, raw in zip(query, cells, strict=True):
        if raw.startswith("[") or raw in ("", "N/A"):
            out[name] = None
            continue
        try:
            out[name] = int(raw, 0) if raw.lower().startswith("0x") else float(raw)
        except ValueError:
            out[name] = raw
    return out


def gpu_clocks(run: Callable[..., Any] = subprocess.run) -> dict[str, Any] | None:
    """SM and memory clocks (and temperature, power, throttle reasons) of the first GPU now,
    from nvidia-smi; None where it is missing or fails."""
    command = [
        "nvidia-smi",
        f"--query-gpu={','.join(CLOCK_QUERY)}",
        "--format=csv,noheader,nounits",
    ]
    try:
        done = run(command, capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return parse_clocks(done.stdout) if done.returncode == 0 else None


class TimingError(Exception):
    """A pending measurement raised while it was timed (``cause``: what it raised)."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__(str(cause))
        self.cause = cause


def interleave(
    count: int,
    rounds: int,
    time_one: Callable[[int, int], Any],
    fatal: tuple[type[BaseException], ...] = (),
) -> tuple[list[list[Any]], list[BaseException | None]]:
    """``time_one(entry, round)`` for every entry in every round, round r in the rotated order
    of :func:`bench.metrics.rotation`. An entry that raises (other than ``fatal``, which
    propagates) is left out of the later rounds. Returns (each entry's per-round results, each
    entry's error or None)."""
    results: list[list[Any]] = [[] for _ in range(count)]
    errors: list[BaseException | None] = [None] * count
    for round_index in range(rounds):
        for entry in metrics.rotation(count, round_index):
            if errors[entry] is not None:
                continue
            try:
                results[entry].append(time_one(entry, round_index))
            except fatal:
                raise
            except Exception as exc:
                errors[entry] = exc
    return results, errors


class RoundTimer:
    """Times pending measurements together: each is registered (:meth:`defer`) with its call,
    input-set count and budget, and :meth:`finish` times a group of them interleaved in
    ``rounds`` rounds (rotating order), each round on the budget's share, then fills each
    target dict with its figures over all repetitions, its per-round medians and the spread
    between rounds. ``timer`` has ``measure(fn, n_sets, budget_ms=, min_reps=)`` and
    ``budget_ms``/``min_reps`` (bench.gpu.Timer, or a fake)."""

    PENDING = "_pending"

    def __init__(
        self, timer: Any, rounds: int, fatal: tuple[type[BaseException], ...] = ()
    ) -> None:
        if rounds < 1:
            raise ValueError(f"rounds={rounds} must be at least 1")
        self.timer, self.rounds, self.fatal = timer, rounds, fatal
        self._pending: dict[int, tuple[Any, Callable[[int], Any], int, float | None]] = {}
        self._next = 0

    def defer(
        self,
        target: dict[str, Any],
        shape: Any,
        fn: Callable[[int], Any],
        n_sets: int,
        budget_ms: float | None = None,
    ) -> None:
        """Mark ``target`` (a row's or candidate's fields) as waiting for ``fn``'s timing."""
        self._next += 1
        self._pending[self._next] = (shape, fn, n_sets, budget_ms)
        target[self.PENDING] = self._next

    def finish(
        self,
        targets: Sequence[dict[str, Any]],
        figures: Callable[[Any, list[float]], dict[str, Any]],
        on_error: Callable[[dict[str, Any], BaseException], None] | None = None,
    ) -> None:
        """Time every target that waits (others are left alone), interleaved; ``figures(shape,
        times)`` gives a row's figures from all its repetitions. A target whose timing raised
        goes to ``on_error(target, exc)``, or, without one, raises TimingError."""
        waiting = [t for t in targets if self.PENDING in t]
        jobs = [self._pending.pop(t.pop(self.PENDING)) for t in waiting]
        rounds = self.rounds
        min_reps = metrics.round_min_reps(self.timer.min_reps, rounds)

        def time_one(entry: int, _round: int) -> tuple[list[float], dict[str, Any]]:
            _, fn, n_sets, budget = jobs[entry]
            share = metrics.round_budget(self.timer.budget_ms if budget is None else budget, rounds)
            return self.timer.measure(fn, n_sets, budget_ms=share, min_reps=min_reps)

        results, errors = interleave(len(jobs), rounds, time_one, self.fatal)
        for target, job, measured, error in zip(waiting, jobs, results, errors, strict=True):
            if error is not None:
                if on_error is None:
                    raise TimingError(error) from error
                on_error(target, error)
                continue
            per_round = [times for times, _ in measured]
            stats = metrics.round_stats(per_round)
            target.update(figures(job[0], [t for times in per_round for t in times]))
            for key in ("rounds", "round_medians_ms", "round_spread"):
                target[key] = stats[key]
            target["timing"] = {
                **measured[0][1],
                "rounds": rounds,
                "reps_per_round": [len(times) for times in per_round],
                "order": "interleaved with the other peers of the shape, rotating",
            }


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
        self.rounds = RoundTimer(self.timer, getattr(args, "rounds", 1), (gpu.FatalGPUError,))
        # True: measure() leaves the timing pending for time_pending() (a shape's peers are then
        # timed together, interleaved); False: measure() times at once (in rounds all the same).
        self.interleave = False

    def figures(self, shape: Any, times: list[float]) -> dict[str, Any]:
        """The figures of a row from its per-call times (ms)."""
        raise NotImplementedError

    def shape_rows(self, shape: Any) -> list[dict[str, Any]]:
        """Every selected peer on one shape."""
        raise NotImplementedError

    def measure(
        self, shape: Any, impl: Any, sets: list, ref: Any, budget_ms: float | None = None
    ) -> tuple[str, dict[str, Any]]:
        """(status, fields) of one implementation: check, memory, then timing (with
        ``interleave`` the timing is left pending: :meth:`time_pending` fills the figures)."""
        gpu, env = self.gpu, self.env
        q, k, v = sets[0]
        out_bytes = metrics.tensor_bytes(shape)["out"]
        tol = getattr(impl, "tolerance", None) or metrics.tolerance(shape.dtype)
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
        self.rounds.defer(fields, shape, lambda i: impl.call(*sets[i]), len(sets), budget_ms)
        if not self.interleave:
            try:
                self.rounds.finish([fields], self.figures)
            except TimingError as failed:
                raise failed.cause from None
        return report.OK, fields

    def time_pending(self, targets: Sequence[dict[str, Any]]) -> None:
        """Time every target ``measure`` left pending, interleaved in rounds; a timing that
        raises makes its target an error (status, reason)."""

        def failed(target: dict[str, Any], exc: BaseException) -> None:
            self.env.sync()  # raises FatalGPUError when the context is gone
            target.update(status=report.ERROR, reason=self.gpu.first_line(exc))

        self.rounds.finish(targets, self.figures, failed)

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


def positive_int(text: str) -> int:
    """argparse type: an integer of at least 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be at least 1")
    return value


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
