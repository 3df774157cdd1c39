"""``python -m bench.model_terms``: how the static model's shape terms rank the committed runs.

Every timed spec of the calibration (:mod:`bench.calibration`: the committed prefill result files
and the stored per-unit predictions in ``bench/results/calibration.json``) is priced for its row's
shape by :func:`kernelgen.model.perfmodel_shape.estimate`, with each term on or off: the per-unit
model alone (units x clocks per unit over the SMs), with the grid fill, with the latency term, with
the HBM/L2 times, and with all of them. For each set of terms the table gives Spearman's rank
correlation of the predicted time with the measured median over the timed specs of each
(arch, dtype, head dim) group, across its shapes, and the median within the rows (one shape and
peer: the autotuner's question). Nothing is compiled: the stored predictions hold the per-unit
clocks and resident blocks the terms need. ``bench.tables`` writes the same table into
docs/performance-model.md.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from bench import calibration, metrics
from kernelgen.errors import KernelgenError
from kernelgen.model.perfmodel import Prediction
from kernelgen.model.perfmodel_shape import ProblemShape, ShapeEstimate, analytic_estimate, estimate
from kernelgen.specs.forward import spec_from_dict

DTYPE_TAG = {"bfloat16": "bf16", "float16": "fp16", "float8_e4m3": "fp8"}


def _with_latency(e: ShapeEstimate) -> float:
    """The factor the latency bound raises the per-unit cost by."""
    return max(e.cost_clocks, e.latency_clocks) / e.cost_clocks


def _default(e: ShapeEstimate) -> float:
    """The terms priced by default: fill, latency and HBM (kernelgen.model.perfmodel_shape)."""
    return max(e.steady_s * e.grid.fill * _with_latency(e), e.hbm_s)


# Each set of terms: the predicted time from a spec's estimates (which report every term): the
# SASS model's, then the tiling-only one the autotuner ranks by (analytic_cost).
TERM_SETS: dict[str, Callable[[Priced], float]] = {
    "per-unit model (before)": lambda p: p.estimate.steady_s,
    "+ grid fill": lambda p: p.estimate.steady_s * p.estimate.grid.fill,
    "+ latency": lambda p: p.estimate.steady_s * _with_latency(p.estimate),
    "+ HBM": lambda p: max(p.estimate.steady_s, p.estimate.hbm_s),
    "+ L2": lambda p: max(p.estimate.steady_s, p.estimate.l2_s),
    "default: fill, latency, HBM": lambda p: _default(p.estimate),
    "default + L2": lambda p: max(_default(p.estimate), p.estimate.l2_s),
    "autotuner's tiling-only cost (before)": lambda p: p.analytic.steady_s,
    "tiling-only + default terms": lambda p: _default(p.analytic),
}


@dataclass(frozen=True)
class Priced:
    """One timed spec with its shape estimate (all terms computed; the sets pick from it)."""

    calibrated: calibration.Calibrated
    estimate: ShapeEstimate
    analytic: ShapeEstimate  # from the tiling alone (perfmodel_shape.analytic_estimate)

    @property
    def group(self) -> tuple[str, str, int]:
        m = self.calibrated.measured
        return m.arch, str(m.fields.get("dtype")), m.head_dim

    @property
    def row(self) -> tuple[str, str, str]:
        m = self.calibrated.measured
        return m.file, m.shape, m.peer


def price(calibrated: Sequence[calibration.Calibrated]) -> tuple[list[Priced], list[str]]:
    """Every modelled spec with a known shape, priced; and one line per spec left out, why."""
    priced, skipped = [], []
    for c in calibrated:
        m = c.measured
        if not c.modelled or not m.batch:
            continue
        model = c.model or {}
        try:
            spec = spec_from_dict(m.fields)
            shape = ProblemShape(m.batch, m.heads, m.seqlen_q, m.seqlen_k, m.kv_heads or m.heads)
            prediction = Prediction(
                dict(model["clocks"]), model["limiter"], model["fraction_of_peak"]
            )
            found = estimate(spec, prediction, m.arch, int(model["blocks_per_sm"]), shape)
            tiling_only = analytic_estimate(spec, m.arch, shape)
        except KernelgenError as exc:
            skipped.append(f"{m.file} {m.shape} {m.label}: {exc}")
            continue
        priced.append(Priced(c, found, tiling_only))
    return priced, skipped


@dataclass(frozen=True)
class TermFit:
    """How one set of terms ranks the measured times: per (arch, dtype, head dim) group across
    its shapes ({group: (specs, rho)}), and the median rho within rows."""

    name: str
    groups: dict[tuple[str, str, int], tuple[int, float | None]]
    row_medians: dict[str, tuple[int, float | None]]  # {peer: (rows, median rho)}


def term_fits(priced: Sequence[Priced]) -> list[TermFit]:
    """A :class:`TermFit` per entry of :data:`TERM_SETS`."""
    fits = []
    for name, predict in TERM_SETS.items():
        by_group: dict[tuple[str, str, int], list[Priced]] = {}
        by_row: dict[tuple[str, str, str], list[Priced]] = {}
        for p in priced:
            by_group.setdefault(p.group, []).append(p)
            by_row.setdefault(p.row, []).append(p)
        groups = {g: _rho(members, predict) for g, members in sorted(by_group.items())}
        per_peer: dict[str, list[float]] = {}
        for (_, _, peer), members in by_row.items():
            rho = _rho(members, predict)[1]
            if rho is not None:
                per_peer.setdefault(peer, []).append(rho)
        medians = {
            peer: (len(rhos), statistics.median(rhos)) for peer, rhos in sorted(per_peer.items())
        }
        fits.append(TermFit(name, groups, medians))
    return fits


def _rho(members: Sequence[Priced], predict: Callable[[Priced], float]) -> tuple[int, float | None]:
    predicted = [predict(p) for p in members]
    measured = [p.calibrated.measured.median_ms for p in members]
    return len(members), metrics.spearman(predicted, measured)


def _cell(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def section(calibrated: Sequence[calibration.Calibrated]) -> str:
    """The markdown table of :func:`term_fits` (bench.tables' ``model-terms`` section)."""
    priced, skipped = price(calibrated)
    fits = term_fits(priced)
    if not fits or not priced:
        return "No timed spec with a stored prediction and a known shape."
    groups, peers = list(fits[0].groups), list(fits[0].row_medians)
    head = [
        f"{a} {DTYPE_TAG.get(t, t)} d{d} ({fits[0].groups[(a, t, d)][0]})" for a, t, d in groups
    ]
    head += [f"{peer} rows ({fits[0].row_medians[peer][0]})" for peer in peers]
    lines = [
        f"Spearman's rho of the predicted time with the measured median time over {len(priced)} "
        "timed specs: per arch, dtype and head dim across their shapes (specs in brackets), then "
        "the median of the rows' rho (one file, shape and peer each, as the autotuner ranks; rows "
        "in brackets). `python -m bench.model_terms` prints it.",
        "",
        "| terms | " + " | ".join(head) + " |",
        "|---|" + "---:|" * len(head),
    ]
    for fit in fits:
        cells = [_cell(fit.groups[g][1]) for g in groups]
        cells += [_cell(fit.row_medians[p][1]) for p in peers]
        lines.append(f"| {fit.name} | " + " | ".join(cells) + " |")
    lines += ["", _level_words(priced)]
    if skipped:
        lines += ["", f"Left out ({len(skipped)}): " + "; ".join(skipped)]
    return "\n".join(lines)


def _level_words(priced: Sequence[Priced]) -> str:
    """Measured over predicted time per peer, with the default terms and with the per-unit model
    alone: the level (1.0: the prediction reached) and its spread."""
    parts = []
    for peer in sorted({p.calibrated.measured.peer for p in priced}):
        members = [p for p in priced if p.calibrated.measured.peer == peer]
        cells = []
        for name in ("default: fill, latency, HBM", "per-unit model (before)"):
            ratios = [p.calibrated.measured.median_ms / 1e3 / TERM_SETS[name](p) for p in members]
            cells.append(f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})")
        parts.append(f"{peer} {cells[0]}, per-unit model alone {cells[1]}")
    return (
        "Measured over predicted time, median (range), with the default terms: "
        + "; ".join(parts)
        + ". The prediction is a ceiling: above 1 is time the model does not see."
    )


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.model_terms", description=__doc__)
    p.add_argument("--results", type=Path, default=calibration.RESULTS_DIR, help="results folder")
    args = p.parse_args(argv)
    results = args.results
    calibrated = calibration.calibrate(
        calibration.all_measured(results),
        calibration.load_models(results / calibration.CALIBRATION_FILE.name),
    )
    print(section(calibrated))
    return 0


if __name__ == "__main__":
    sys.exit(main())
