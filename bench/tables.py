"""``python -m bench.tables [--check]``: the performance tables of the docs, generated from the
committed result files (never typed).

A document holds each table between two markers::

    <!-- tables:begin NAME -->
    ...generated...
    <!-- tables:end NAME -->

and :data:`SECTIONS` says which document holds which NAME and what writes it. Without
``--check`` every section is rewritten in place (atomically); with ``--check`` nothing is
written and the exit status is 1 when any section differs from what would be written (one
line per section on stderr), 2 on unreadable input. Every table names its result file, the
commit it measured (a provenance sidecar overrides the file's own, see
:mod:`bench.results_io`) and the device. Ratios are median time over median time; a ratio is a
win or a loss only when it departs from 1 by more than the two rows' noise added
(:func:`bench.metrics.verdict`: the spread between timing rounds, or the p10-p90 width for
files written before rounds existed).
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

from bench import calibration, metrics, model_terms, results_io
from bench.harness import ROOT
from bench.report import md_table, write_atomic
from bench.shapes import DTYPE_SHORT
from kernelgen.errors import InputError

RESULTS = ROOT / "bench" / "results"
FLASH, CUDNN, TC, WGMMA = "torch-flash", "torch-cudnn", "kg-tc-v2", "kg-wgmma"
PREFILL_2026_11_25 = "2026-11-25-nvidia-h100-80gb-hbm3.json"
WGMMA_2026_11_26 = (
    "2026-11-26-nvidia-h100-80gb-hbm3-wgmma.json",
    "2026-11-26-nvidia-h100-80gb-hbm3-wgmma-d64-d256.json",
)
# bench.session's prefill stages of 2026-11-26 (runs 4, 5 and 6): the wgmma kernels of each commit
SESSIONS_2026_11_26 = (
    "2026-11-26-nvidia-h100-80gb-hbm3-session.json",
    "2026-11-26-nvidia-h100-80gb-hbm3-session-long.json",
    "2026-11-26-nvidia-h100-80gb-hbm3-run5-session.json",
    "2026-11-26-nvidia-h100-80gb-hbm3-run6-session.json",
)
BEGIN = "<!-- tables:begin {name} -->"
END = "<!-- tables:end {name} -->"
_MARKER = re.compile(r"<!-- tables:(begin|end) ([A-Za-z0-9_.-]+) -->")


# ---- cells ---------------------------------------------------------------------------------------
def rel(path: Path, root: Path = ROOT) -> str:
    try:
        return str(path.relative_to(root))
    except ValueError:
        return str(path)


def rate_cell(row: dict[str, Any] | None, spread: bool = True) -> str:
    """TFLOP/s of the median, with the TFLOP/s of the p90 and p10 times: ``358 (351-364)``."""
    if row is None:
        return "-"
    if row.get("status") != "ok" or not row.get("tflops"):
        return str(row.get("status", "-"))
    text = f"{row['tflops']:.0f}"
    p10, p90, median = row.get("p10_ms"), row.get("p90_ms"), row.get("median_ms")
    if spread and p10 and p90 and median:
        low, high = row["tflops"] * median / p90, row["tflops"] * median / p10
        text += f" ({low:.0f}-{high:.0f})"
    return text


def ratio_cell(row: dict[str, Any] | None, other: dict[str, Any] | None) -> str:
    """``1.04x (noise)``: the ratio of ``row`` over ``other`` and its call."""
    if row is None or other is None or row.get("status") != "ok" or other.get("status") != "ok":
        return "-"
    judged = metrics.verdict(row, other)
    if judged["ratio"] is None:
        return "-"
    call = {metrics.WITHIN_NOISE: "noise", None: "?"}.get(judged["call"], judged["call"])
    return f"{judged['ratio']:.2f}x ({call})"


def shape_cells(row: dict[str, Any]) -> list[str]:
    dtype = DTYPE_SHORT.get(row["dtype"], row["dtype"])
    return [dtype, str(row["head_dim"]), "yes" if row["causal"] else "-", str(row["seqlen_q"])]


SHAPE_HEADER = ["dtype", "D", "causal", "S"]


@dataclass(frozen=True)
class Run:
    """A loaded prefill result file with its provenance."""

    path: Path
    data: dict[str, Any]

    @property
    def meta(self) -> dict[str, Any]:
        return self.data["meta"]

    @cached_property
    def origin(self) -> results_io.Provenance:
        return results_io.provenance(self.path, self.meta)

    def heading(self) -> str:
        """The sentence naming the file, commit, templates and device of a table."""
        return (
            f"From `{rel(self.path)}`: {self.origin.describe()}, template hash "
            f"{str(self.meta.get('template_hash'))[:8]}, {results_io.device(self.meta)}, "
            f"{self.meta.get('date')}; {self.noise_words()}."
        )

    def noise_words(self) -> str:
        rounds = self.data.get("settings", {}).get("timing_rounds")
        if rounds and rounds > 1:
            return (
                f"{rounds} interleaved timing rounds per row; noise = the spread between "
                "rounds (largest minus smallest round median, over the median)"
            )
        return (
            "one timing per row (written before timing rounds existed); noise = the p10-p90 "
            "width of the repetitions over the median"
        )

    @cached_property
    def rows(self) -> dict[tuple[str, str], dict[str, Any]]:
        """{(shape key, peer): row}, built once per file."""
        return results_io.rows_by(self.data)

    def row(self, shape: str, peer: str) -> dict[str, Any] | None:
        return self.rows.get((shape, peer))

    def shapes(self) -> list[str]:
        return results_io.shape_keys(self.data)


def load_run(path: Path) -> Run:
    return Run(path, results_io.load_prefill(path))


def candidate(row: dict[str, Any] | None, label: str) -> dict[str, Any] | None:
    for cand in (row or {}).get("candidates") or []:
        if cand.get("label") == label:
            return cand
    return None


def ratio_summary(run: Run, peer: str, other: str) -> str:
    """``kg-tc-v2 / torch-flash: 0.99-1.05x (median 1.04x) over 8 shapes; 0 wins, 8 within
    noise, 0 losses``."""
    judged = []
    for shape in run.shapes():
        mine, theirs = run.row(shape, peer), run.row(shape, other)
        if mine and theirs and mine.get("status") == "ok" and theirs.get("status") == "ok":
            judged.append(metrics.verdict(mine, theirs))
    ratios = [j["ratio"] for j in judged if j["ratio"] is not None]
    if not ratios:
        return f"{peer} / {other}: no shape has both timed"
    calls = [j["call"] for j in judged]
    return (
        f"{peer} / {other}: {min(ratios):.2f}-{max(ratios):.2f}x (median "
        f"{statistics.median(ratios):.2f}x) over {len(ratios)} shapes; "
        f"beyond the noise {calls.count(metrics.WIN)} faster, {calls.count(metrics.LOSS)} "
        f"slower, {calls.count(metrics.WITHIN_NOISE)} within it"
    )


RATIO_LEGEND = (
    "Ratios: the other peer's median time over this one's (above 1: kernelgen faster); "
    "(win)/(loss) only when the ratio departs from 1 by more than the two rows' noise added, "
    "else (noise)."
)


# ---- sections ------------------------------------------------------------------------------------
RATE_LEGEND = (
    "TFLOP/s of the median time (in brackets: TFLOP/s at the p90 and p10 times). " + RATIO_LEGEND
)
SHAPE_ALIGN = ["---", "---:", "---", "---:"]


def versus_torch(
    run: Run,
    peer: str,
    short: str,
    rated: dict[str, str],
    extra: dict[str, Callable[[dict[str, Any]], str]] | None = None,
) -> list[str]:
    """The table of ``peer``'s rows of ``run`` against torch's flash and cuDNN backends, then
    one summary line per backend. Columns: the shape, the TFLOP/s of flash, cuDNN and of each
    ``rated`` peer (peer: column name), ``peer``'s spec, the ``extra`` columns (name: cell of
    ``peer``'s row), and ``peer``'s ratios (named ``short / flash``, ``short / cuDNN``)."""
    extra = extra or {}
    lines = []
    for shape in run.shapes():
        mine = run.row(shape, peer)
        if mine is None:
            continue
        flash, cudnn = run.row(shape, FLASH), run.row(shape, CUDNN)
        lines.append(
            [
                *shape_cells(mine),
                rate_cell(flash),
                rate_cell(cudnn),
                *(rate_cell(run.row(shape, other)) for other in rated),
                f"`{mine.get('best_label', '-')}`",
                *(make(mine) for make in extra.values()),
                ratio_cell(mine, flash),
                ratio_cell(mine, cudnn),
            ]
        )
    header = [*SHAPE_HEADER, "torch flash", "torch cuDNN", *rated.values(), "its spec", *extra]
    header += [f"{short} / flash", f"{short} / cuDNN"]
    align = [*SHAPE_ALIGN, *["---:"] * (2 + len(rated)), "---", *["---:"] * (len(extra) + 2)]
    return [
        md_table(header, lines, align),
        "",
        f"- {ratio_summary(run, peer, FLASH)}",
        f"- {ratio_summary(run, peer, CUDNN)}",
    ]


def prefill_section(run: Run) -> str:
    """A kg-tc-v2 run against torch's flash and cuDNN backends, with the candidate labelled
    ``default`` (the heuristic default of that commit, screening figure)."""
    default = {
        "`default` spec (screening)": lambda tc: rate_cell(candidate(tc, "default"), spread=False)
    }
    table = versus_torch(run, TC, "kg-tc", {TC: "kg-tc-v2 (best spec, re-timed)"}, default)
    return "\n".join([run.heading(), RATE_LEGEND, "", *table])


def wgmma_section(runs: Sequence[Run]) -> str:
    """kg-wgmma (best of its candidates, re-timed) against torch flash, cuDNN and kg-tc-v2."""
    parts = [RATE_LEGEND]
    for run in runs:
        table = versus_torch(run, WGMMA, "wgmma", {TC: "kg-tc-v2", WGMMA: "kg-wgmma"})
        parts += ["", run.heading(), "", *table]
    return "\n".join(parts)


def measured_section(runs: Sequence[Run]) -> str:
    """The README's short table: per shape of every prefill run, kernelgen over torch."""
    lines = []
    for index, run in enumerate(runs, 1):
        for shape in run.shapes():
            tc, wg = run.row(shape, TC), run.row(shape, WGMMA)
            first = tc or wg
            if first is None:
                continue
            flash, cudnn = run.row(shape, FLASH), run.row(shape, CUDNN)
            lines.append(
                [
                    f"[{index}]",
                    *shape_cells(first),
                    ratio_cell(tc, flash),
                    ratio_cell(tc, cudnn),
                    ratio_cell(wg, flash),
                    ratio_cell(wg, cudnn),
                ]
            )
    header = ["run", *SHAPE_HEADER, "kg-tc-v2 / flash", "kg-tc-v2 / cuDNN"]
    header += ["kg-wgmma / flash", "kg-wgmma / cuDNN"]
    align = ["---", *SHAPE_ALIGN, "---:", "---:", "---:", "---:"]
    notes = [
        f"[{i}] `{rel(run.path)}`: {run.origin.describe()}, {results_io.device(run.meta)}, "
        f"{run.meta.get('date')}; {run.noise_words()}."
        for i, run in enumerate(runs, 1)
    ]
    return "\n".join(
        [
            "Forward pass, 16k tokens per batch; kernelgen's best spec per shape (re-timed). "
            + RATIO_LEGEND,
            "",
            md_table(header, lines, align),
            "",
            *notes,
        ]
    )


# ---- calibration sections ------------------------------------------------------------------------
def _fmt(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def calibration_full_section(calibrated: Sequence[calibration.Calibrated]) -> str:
    """Every timed spec beside its prediction."""
    lines = []
    for c in calibrated:
        m, model = c.measured, c.model or {}
        lines.append(
            [
                m.file.removesuffix(".json"),
                m.shape,
                f"`{m.label}`" + (" (best)" if m.winner else ""),
                f"{m.median_ms:.4f}",
                _fmt(m.tflops, 0),
                _fmt(c.measured_fraction),
                model.get("limiter", model.get("error", "not modelled"))[:60],
                _fmt(model.get("cost_clocks"), 0),
                _fmt(model.get("analytic_cost_clocks"), 0),
                _fmt(c.predicted_fraction),
                _fmt(c.efficiency),
            ]
        )
    header = [
        "run",
        "shape",
        "candidate",
        "median ms",
        "TFLOP/s",
        "of matmul",
        "model: bound by",
        "model clk/unit",
        "tuner clk/unit",
        "model: of peak",
        "measured / model",
    ]
    align = ["---", "---", "---", "---:", "---:", "---:", "---", "---:", "---:", "---:", "---:"]
    return "\n".join(
        [
            CALIBRATION_LEGEND,
            "",
            md_table(header, lines, align),
        ]
    )


CALIBRATION_LEGEND = (
    "Measured: the candidate's screening median (all candidates of a row were timed the same "
    "way) and its TFLOP/s over the run's measured 8192^3 matmul rate (`of matmul`, standing for "
    "the attainable dense tensor peak). Model: `kernelgen model` of the same spec from the "
    "templates the run measured (clocks per 64 x 64 unit on sm_90, wgmma specs on sm_90a; the "
    "binding resource), the tiling-only cost the autotuner ranks candidates by (`tuner`), and "
    "the model's ceiling as a fraction of the dense wgmma peak (`of peak`: the unit's "
    "multiply-adds at 2048 per clock over the model's clocks). `measured / model`: of matmul "
    "over of peak (1.0: the model's ceiling reached)."
)


def calibration_summary_section(calibrated: Sequence[calibration.Calibrated]) -> str:
    """The model's error in words and per row of candidates, and the overlap pairs."""
    modelled = [c for c in calibrated if c.efficiency is not None]
    files = sorted({c.measured.file for c in calibrated})
    fits = calibration.group_fits(calibrated)
    lines = [
        f"From {len(files)} result files in `bench/results/` "
        f"({', '.join(f'`{f}`' for f in files)}) and the stored predictions in "
        f"`{rel(calibration.CALIBRATION_FILE)}`; the full table, one line per spec, is in "
        "`bench/results/calibration.md`.",
        "",
    ]
    if not modelled:
        return "\n".join([*lines, "No timed spec has a prediction."])
    lines.append(_error_words(calibrated, modelled, fits))
    lines += ["", _fits_table(fits), "", _overlap_words(calibration.overlap_pairs(calibrated))]
    return "\n".join(lines)


def _spread(values: Sequence[float]) -> str:
    """``0.45-1.21 (median 0.75)``; one value when all are equal (to two decimals)."""
    if not values:
        return "-"
    low, high = f"{min(values):.2f}", f"{max(values):.2f}"
    if low == high:
        return f"{low} throughout"
    return f"{low}-{high} (median {statistics.median(values):.2f})"


def _error_words(
    calibrated: Sequence[calibration.Calibrated],
    modelled: Sequence[calibration.Calibrated],
    fits: Sequence[calibration.GroupFit],
) -> str:
    parts = []
    for family, peer in (("mma.sync", TC), ("wgmma", WGMMA)):
        ratios = [c.efficiency for c in modelled if c.measured.peer == peer]
        if ratios:
            parts.append(f"{family} {_spread(ratios)} over {len(ratios)} specs")  # type: ignore[arg-type]
    model_rho = [f.model_rho for f in fits if f.model_rho is not None]
    tuner_rho = [f.tuner_rho for f in fits if f.tuner_rho is not None]
    hits = sum(1 for f in fits if f.model_first == f.best_label)
    tuner_hits = sum(1 for f in fits if f.tuner_first == f.best_label)
    missing = len(calibrated) - len(modelled)
    matmul = [c.measured.matmul_tflops for c in modelled if c.measured.matmul_tflops]
    return (
        f"**The model's error on every measured spec** ({len(modelled)} timed specs"
        + (f"; {missing} without a prediction" if missing else "")
        + "): the measured fraction of the matmul rate over the model's predicted fraction of "
        f"the peak is {'; '.join(parts)}. The matmul (cuBLAS, {min(matmul):.0f}-"
        f"{max(matmul):.0f} TFLOP/s in these runs) stands for the peak, so the level is "
        "relative and values above 1 occur; a constant would mean the model is right up to one "
        "factor, and the spread is its error. Within each row's candidates, the "
        f"rank correlation of the model's cost with the measured times is {_spread(model_rho)} "
        f"over {len(model_rho)} rows (1.0: the same order), that of the autotuner's tiling-only "
        f"cost {_spread(tuner_rho)}; the model's first choice was the measured fastest in "
        f"{hits} of {len(fits)} rows, the autotuner's in {tuner_hits}, and their first choices "
        f"ran at most {max(f.model_first_slowdown for f in fits):.2f}x and "
        f"{max(f.tuner_first_slowdown for f in fits):.2f}x the fastest's time."
    )


def _fits_table(fits: Sequence[calibration.GroupFit]) -> str:
    lines = [
        [
            f.file.removesuffix(".json"),
            f.shape,
            f.peer,
            str(f.count),
            _fmt(f.model_rho),
            _fmt(f.tuner_rho),
            f"`{f.best_label}`",
            f"`{f.model_first}` ({f.model_first_slowdown:.2f}x)",
            f"`{f.tuner_first}` ({f.tuner_first_slowdown:.2f}x)",
        ]
        for f in fits
    ]
    header = ["run", "shape", "peer", "specs", "model rho", "tuner rho", "fastest measured"]
    header += ["model's first (time / fastest)", "autotuner's first"]
    align = ["---", "---", "---", "---:", "---:", "---:", "---", "---", "---"]
    return md_table(header, lines, align)


def _overlap_words(pairs: Sequence[calibration.OverlapPair]) -> str:
    if not pairs:
        return "No overlapped (`-ovl`) wgmma candidate was timed beside its plain tiling."
    lines = [
        [
            p.file.removesuffix(".json"),
            p.shape,
            f"`{p.plain.measured.label}`",
            _fmt(p.plain.measured.tflops, 0),
            _fmt(p.overlap.measured.tflops, 0),
            f"{p.measured_ratio:.2f}x",
            "-" if p.predicted_ratio is None else f"{p.predicted_ratio:.2f}x",
        ]
        for p in pairs
    ]
    slower = sum(1 for p in pairs if p.measured_ratio < 1)
    predicted = [p.predicted_ratio for p in pairs if p.predicted_ratio is not None]
    header = ["run", "shape", "tiling", "plain TFLOP/s", "-ovl TFLOP/s", "measured ovl / plain"]
    header.append("model ovl / plain")
    align = ["---", "---", "---", "---:", "---:", "---:", "---:"]
    return "\n".join(
        [
            f"**Intra-warpgroup overlap** (`overlap: true`, the `-ovl` candidates): measured "
            f"slower than the same tiling without it in {slower} of {len(pairs)} pairs: the "
            f"plain time over the overlapped time is {_spread([p.measured_ratio for p in pairs])}"
            f", where the model's clocks per unit gave {_spread(predicted)}. It counts "
            "instructions and shared-memory bytes per unit, which the overlap barely changes; "
            "what the overlap costs on hardware (registers, waits) is outside it.",
            "",
            md_table(header, lines, align),
        ]
    )


# ---- the registry, reading and writing -----------------------------------------------------------
@dataclass(frozen=True)
class Section:
    document: Path
    name: str
    make: Callable[[Path], str]  # the results folder -> the section's text


def _calibrated(results: Path) -> list[calibration.Calibrated]:
    return calibration.calibrate(
        calibration.all_measured(results),
        calibration.load_models(results / calibration.CALIBRATION_FILE.name),
    )


def _runs(results: Path, names: Sequence[str]) -> list[Run]:
    return [load_run(results / name) for name in names]


SECTIONS = (
    Section(
        ROOT / "bench" / "NOTES.md",
        "prefill-2026-11-25",
        lambda r: prefill_section(load_run(r / PREFILL_2026_11_25)),
    ),
    Section(
        ROOT / "bench" / "NOTES.md",
        "wgmma-2026-11-26",
        lambda r: wgmma_section(_runs(r, WGMMA_2026_11_26)),
    ),
    Section(
        ROOT / "README.md",
        "measured",
        lambda r: measured_section(
            _runs(r, (PREFILL_2026_11_25, *WGMMA_2026_11_26, *SESSIONS_2026_11_26))
        ),
    ),
    Section(
        ROOT / "docs" / "performance-model.md",
        "calibration",
        lambda r: calibration_summary_section(_calibrated(r)),
    ),
    Section(
        ROOT / "docs" / "performance-model.md",
        "model-terms",
        lambda r: model_terms.section(_calibrated(r)),
    ),
    Section(
        ROOT / "bench" / "results" / "calibration.md",
        "calibration-specs",
        lambda r: calibration_full_section(_calibrated(r)),
    ),
)


def replace_section(text: str, name: str, body: str, where: str = "document") -> str:
    """``text`` with the lines between NAME's markers replaced by ``body``; an InputError when
    the markers are missing, repeated or out of order."""
    begin, end = BEGIN.format(name=name), END.format(name=name)
    if text.count(begin) != 1 or text.count(end) != 1:
        raise InputError(f"{where}: needs exactly one '{begin}' and one '{end}' line")
    head, rest = text.split(begin, 1)
    if end not in rest:
        raise InputError(f"{where}: '{end}' comes before '{begin}'")
    _, tail = rest.split(end, 1)
    return f"{head}{begin}\n{body.strip()}\n{end}{tail}"


def unknown_markers(text: str, known: set[str]) -> list[str]:
    """Section names marked in ``text`` that nothing generates."""
    return sorted({name for _, name in _MARKER.findall(text)} - known)


def render_documents(
    sections: Sequence[Section], results: Path
) -> dict[Path, tuple[str, str, list[str]]]:
    """{document: (current text, generated text, names of the sections that differ)}."""
    out: dict[Path, tuple[str, str, list[str]]] = {}
    for section in sections:
        if section.document not in out:
            text = section.document.read_text() if section.document.exists() else ""
            out[section.document] = (text, text, [])
        current, generated, changed = out[section.document]
        new = replace_section(generated, section.name, section.make(results), rel(section.document))
        if new != generated:
            changed.append(section.name)
        out[section.document] = (current, new, changed)
    for document, (_, generated, _) in out.items():
        known = {s.name for s in sections if s.document == document}
        stray = unknown_markers(generated, known)
        if stray:
            raise InputError(f"{rel(document)}: unknown table section(s) {', '.join(stray)}")
    return out


def write_keeping_mode(path: Path, text: str) -> None:
    """Replace ``path`` atomically, keeping its permission bits (the atomic writer gives the
    umask's); a new file gets 0o644."""
    mode = path.stat().st_mode & 0o777 if path.exists() else 0o644
    write_atomic(path, text)
    path.chmod(mode)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.tables",
        description="Regenerate the marked performance tables in bench/NOTES.md, README.md, "
        "docs/performance-model.md and bench/results/calibration.md from the result files.",
    )
    p.add_argument("--check", action="store_true", help="write nothing; exit 1 if any differs")
    p.add_argument("--results", type=Path, default=RESULTS, help="result files' folder")
    args = p.parse_args(argv)
    try:
        documents = render_documents(SECTIONS, args.results)
    except InputError as exc:
        print(f"tables: {exc}", file=sys.stderr)
        return 2
    stale = 0
    for document, (current, generated, changed) in documents.items():
        if generated == current:
            continue
        stale += 1
        if args.check:
            for name in changed or ["(document)"]:
                print(f"tables: {rel(document)}: section {name} is out of date", file=sys.stderr)
        else:
            write_keeping_mode(document, generated)
            print(f"tables: rewrote {', '.join(changed)} in {rel(document)}")
    if args.check and stale:
        print("tables: run python -m bench.tables to regenerate", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
