"""Timing candidates behind a small interface, so tests can inject a fake.

A :class:`Bench` compiles a spec (outside any timed region), times a launch of it (a spec and,
for split-KV specs, a split count; one duration per repetition, in ms) and checks its output
against a reference once. The flow here is GPU-free, in three rounds of growing budgets (a
successive halving): a short screen of every candidate where there are many, a full pass of
the best of the screen, a re-timing of the best few; a candidate that fails to compile or
launch scores infinity and tuning goes on; the winner's output is checked, and a mismatch
rejects it in favour of the next best.
"""

from __future__ import annotations

import logging
import math
import statistics
from dataclasses import dataclass
from typing import Protocol

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from kernelgen.errors import KernelgenError
from kernelgen.families import AnySpec
from kernelgen.tuning.candidates import TunedLaunch

log = logging.getLogger(__name__)


class Bench(Protocol):
    """What the autotuner needs from a GPU (or from a fake one in tests)."""

    def compile(self, spec: AnySpec) -> None:
        """Build the kernel for the current device; raises if it cannot."""

    def time(
        self,
        spec: AnySpec,
        budget_ms: float,
        num_splits: int | None = None,
        *,
        min_reps: int,
    ) -> list[float]:
        """Warm up, then per-repetition durations in ms: about ``budget_ms`` of them, and at
        least ``min_reps``."""

    def check(self, spec: AnySpec, num_splits: int | None = None) -> str | None:
        """None when the kernel's output matches the reference, else why not."""


@dataclass(frozen=True)
class MeasureSettings:
    budget_ms: float = 200.0  # timed work per candidate of the full pass
    min_reps: int = 20  # repetitions of a full pass or re-timing, however long a launch takes
    retime_top: int = 3  # candidates timed again before choosing
    retime_budget_ms: float = 400.0
    # With more than screen_keep candidates, each is first timed for screen_budget_ms and only
    # the fastest max(screen_keep, screen_share of them) go on to the full pass: the slow bulk
    # of a large candidate set (tilings 1.5-10x off the best) costs a quarter of the time.
    screen_budget_ms: float = 50.0
    screen_keep: int = 6
    screen_share: float = 0.25
    # The screen's own floor: a launch longer than screen_budget_ms / min_reps (2.5 ms) would
    # otherwise take min_reps repetitions and the screen would save nothing. A few repetitions
    # of a long launch are steady enough to tell a candidate 1.5x off the best.
    screen_min_reps: int = 5

    def kept_after_screen(self, timed: int) -> int:
        """How many of ``timed`` candidates (finite screen times) go on to the full pass."""
        return min(timed, max(self.screen_keep, math.ceil(self.screen_share * timed)))


@dataclass
class Measurement:
    launch: TunedLaunch
    median_ms: float = math.inf  # full pass (screened out: the screen); inf when it failed
    retime_ms: float | None = None
    spread_ms: float | None = None  # interquartile range of the samples used
    samples: int = 0
    status: str = "timed"  # timed | screened (out) | failed | rejected | winner
    reason: str = ""
    screen_ms: float | None = None  # the screen's median, where there was a screen

    @property
    def spec(self) -> AnySpec:
        return self.launch.spec

    @property
    def num_splits(self) -> int | None:
        return self.launch.num_splits

    @property
    def score(self) -> float:
        """What the winner is chosen by: the re-timed median where there is one."""
        return self.retime_ms if self.retime_ms is not None else self.median_ms

    def as_dict(self) -> dict[str, object]:
        def finite(x: float | None) -> float | None:
            return None if x is None or math.isinf(x) else round(x, 6)

        return {
            "uri": self.spec.uri,
            "spec": self.spec.model_dump(mode="json"),
            "num_splits": self.num_splits,
            "median_ms": finite(self.median_ms),
            "retime_ms": finite(self.retime_ms),
            "screen_ms": finite(self.screen_ms),
            "spread_ms": finite(self.spread_ms),
            "samples": self.samples,
            "status": self.status,
            "reason": self.reason,
        }


def _summary(samples: list[float]) -> tuple[float, float]:
    """(median, interquartile range) of per-repetition times."""
    if not samples:
        raise ValueError("the bench returned no samples")
    if len(samples) < 4:
        return statistics.median(samples), 0.0
    q1, _, q3 = statistics.quantiles(samples, n=4)
    return statistics.median(samples), q3 - q1


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}".rstrip(": ")


def _time_one(bench: Bench, m: Measurement, budget_ms: float, min_reps: int, round_: str) -> None:
    """Time ``m`` in one round: "screen", "full" or "retime" (the first timing of a candidate
    compiles it first, outside the timed region); a failure scores infinity."""
    try:
        if m.samples == 0:
            bench.compile(m.spec)
        samples = bench.time(m.spec, budget_ms, num_splits=m.num_splits, min_reps=min_reps)
        median, spread = _summary(samples)
    except (KernelgenError, RuntimeError, ValueError, TypeError, OSError, MemoryError) as exc:
        m.median_ms, m.retime_ms, m.status = math.inf, None, "failed"
        m.reason = _first_line(exc)
        log.warning("candidate %s failed: %s", m.launch.label, m.reason)
        return
    if round_ == "retime":
        m.retime_ms = median
    else:
        m.median_ms = median
        if round_ == "screen":
            m.screen_ms = median
    m.spread_ms, m.samples = spread, len(samples)


def ranked(measurements: list[Measurement]) -> list[Measurement]:
    """Fastest first, candidates screened out after all others (their only time is the short
    screen's); ties broken by the label so the choice is deterministic."""
    return sorted(measurements, key=lambda m: (m.status == "screened", m.score, m.launch.label))


def measure(
    launches: list[TunedLaunch] | list[AnySpec],
    bench: Bench,
    settings: MeasureSettings | None = None,
    console: Console | None = None,
) -> tuple[Measurement | None, list[Measurement]]:
    """Time every launch (a bare spec: its heuristic split count): a screen where there are many,
    the full pass, a re-timing of the best few; check the winner; (winner or None, all)."""
    settings = settings or MeasureSettings()
    results = [Measurement(x if isinstance(x, TunedLaunch) else TunedLaunch(x)) for x in launches]
    screening = len(results) > settings.screen_keep
    console = console or Console(stderr=True)
    columns = (
        TextColumn("[bold]tuning"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total} {task.description}"),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=console, transient=True) as progress:
        full_pass = settings.kept_after_screen(len(results)) if screening else 0
        task = progress.add_task("", total=len(results) + full_pass + settings.retime_top)

        def run_round(batch: list[Measurement], budget_ms: float, round_: str) -> None:
            reps = settings.screen_min_reps if round_ == "screen" else settings.min_reps
            for m in batch:
                progress.update(task, description=f"{round_} {m.launch.label}")
                _time_one(bench, m, budget_ms, reps, round_)
                progress.advance(task)

        if screening:
            run_round(results, settings.screen_budget_ms, "screen")
            timed = [m for m in ranked(results) if math.isfinite(m.score)]
            kept = settings.kept_after_screen(len(timed))
            for place, m in enumerate(timed[kept:], start=kept + 1):
                m.status = "screened"
                m.reason = (
                    f"screened out: {m.median_ms:.4g} ms in the {settings.screen_budget_ms:g} ms "
                    f"screen, place {place} of {len(timed)} (the best {kept} went on)"
                )
            run_round(timed[:kept], settings.budget_ms, "full")
        else:
            run_round(results, settings.budget_ms, "full")
        top = [m for m in ranked(results) if math.isfinite(m.score) and m.status != "screened"]
        run_round(top[: settings.retime_top], settings.retime_budget_ms, "retime")
    return choose(results, bench), results


def choose(results: list[Measurement], bench: Bench) -> Measurement | None:
    """The fastest candidate whose output passes the reference check (None if none does)."""
    for m in ranked(results):
        if not math.isfinite(m.score):
            break
        try:
            problem = bench.check(m.spec, num_splits=m.num_splits)
        except (KernelgenError, RuntimeError, ValueError, TypeError, MemoryError) as exc:
            problem = _first_line(exc)
        if problem is None:
            m.status = "winner"
            return m
        m.status, m.reason = "rejected", f"output check failed: {problem}"
        log.warning("rejected %s: %s", m.launch.label, m.reason)
    return None
