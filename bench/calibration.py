"""``python -m bench.calibration``: the static performance model against every timed spec.

Every kernelgen tensor-core spec a committed prefill result file timed (the candidates of the
``kg-tc-v2`` and ``kg-wgmma`` rows, each with its screening median) is set beside the static
model's prediction for the same spec (:func:`kernelgen.model.perfmodel.model_spec`, from the SASS)
and the tiling-only cost the autotuner ranks its candidates by
(:func:`kernelgen.model.perfmodel.analytic_cost`).

The model is computed from the templates the run measured: the commit of each result file
(its provenance) is exported with ``git archive`` into a temporary folder, checked against the
file's ``meta.template_hash``, and modelled in a subprocess with ``KERNELGEN_TEMPLATE_DIR``
pointing there. Modelling needs NVRTC and two offline compiles per spec (seconds each), so the
predictions are stored in ``bench/results/calibration.json``, keyed by template hash, arch and
spec: ``python -m bench.calibration`` models only the specs that file lacks, and the tables
(``python -m bench.tables``) read it without compiling anything.

``--check`` exits 1 when a timed spec has no stored prediction (run without ``--check`` where
NVRTC is installed to add it).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench import metrics, results_io
from bench.harness import ROOT
from bench.report import to_json, write_atomic
from kernelgen.errors import InputError, KernelgenError

RESULTS_DIR = ROOT / "bench" / "results"
CALIBRATION_FILE = RESULTS_DIR / "calibration.json"
CALIBRATION_SCHEMA = 1
MODELLED_PEERS = ("kg-tc-v2", "kg-wgmma")
# The committed prefill result files the calibration covers (bench.attention documents).
PREFILL_GLOB = "*-nvidia-*.json"
NOT_PREFILL_SUFFIXES = ("-tuning.json", "-decode.json", "-variants.json", "-serving.json")
DENSE_MACS_PER_CLOCK = 2048  # wgmma's fp16/bf16 rate per SM (kernelgen.model.perfmodel.RATES)


@dataclass(frozen=True)
class MeasuredSpec:
    """One timed candidate of a kernelgen row: where it was measured and what it measured."""

    file: str
    shape: str
    peer: str
    label: str
    uri: str
    fields: dict[str, Any]
    arch: str
    template_hash: str
    head_dim: int
    median_ms: float
    p10_ms: float | None
    p90_ms: float | None
    tflops: float | None
    matmul_tflops: float | None
    winner: bool
    # the row's sizes (bench.model_terms prices the shape terms with them)
    batch: int = 0
    heads: int = 0
    kv_heads: int = 0
    seqlen_q: int = 0
    seqlen_k: int = 0

    @property
    def model_key(self) -> str:
        return model_key(self.template_hash, self.arch, self.uri)


def model_key(template_hash: str, arch: str, uri: str) -> str:
    """Key of a stored prediction: the first 12 hex digits of the template hash, arch, spec."""
    return f"{template_hash[:12]}/{arch}/{uri}"


def prefill_files(results_dir: Path = RESULTS_DIR) -> list[Path]:
    """The prefill result files (``bench.attention`` JSON) of ``results_dir``, sorted by name."""
    return [
        p
        for p in sorted(results_dir.glob(PREFILL_GLOB))
        if not p.name.endswith(NOT_PREFILL_SUFFIXES)
    ]


def spec_arch(fields: dict[str, Any], compute_capability: str) -> str:
    """The arch a spec is modelled on: wgmma specs on sm_90a, the rest on the device's arch."""
    if fields.get("mma") == "wgmma":
        return "sm_90a"
    return f"sm_{compute_capability}"


def measured_specs(path: Path, data: dict[str, Any]) -> list[MeasuredSpec]:
    """Every candidate a kernelgen row of ``data`` timed correctly (status ``ok``)."""
    meta = data["meta"]
    matmul = data.get("floors", {}).get("matmul_tflops", {})
    found = []
    for row in data["rows"]:
        if row.get("peer") not in MODELLED_PEERS:
            continue
        winner = row.get("best_label")
        for cand in row.get("candidates") or []:
            if cand.get("status") != "ok" or not cand.get("median_ms"):
                continue
            found.append(
                MeasuredSpec(
                    file=path.name,
                    shape=row["shape"],
                    peer=row["peer"],
                    label=cand["label"],
                    uri=cand["spec_uri"],
                    fields=cand["fields"],
                    arch=spec_arch(cand["fields"], str(meta.get("compute_capability", "90"))),
                    template_hash=str(meta.get("template_hash") or "unknown"),
                    head_dim=int(row["head_dim"]),
                    median_ms=float(cand["median_ms"]),
                    p10_ms=cand.get("p10_ms"),
                    p90_ms=cand.get("p90_ms"),
                    tflops=cand.get("tflops"),
                    matmul_tflops=matmul.get(row["dtype"]),
                    winner=cand["label"] == winner,
                    batch=int(row.get("batch") or 0),
                    heads=int(row.get("heads") or 0),
                    kv_heads=int(row.get("kv_heads") or row.get("heads") or 0),
                    seqlen_q=int(row.get("seqlen_q") or 0),
                    seqlen_k=int(row.get("seqlen_k") or 0),
                )
            )
    return found


def all_measured(results_dir: Path = RESULTS_DIR) -> list[MeasuredSpec]:
    out: list[MeasuredSpec] = []
    for path in prefill_files(results_dir):
        out += measured_specs(path, results_io.load_prefill(path))
    return out


# ---- the stored predictions --------------------------------------------------------------------
def load_models(path: Path = CALIBRATION_FILE) -> dict[str, dict[str, Any]]:
    """The stored predictions ({model key: entry}); empty when the file does not exist."""
    if not path.exists():
        return {}
    data = results_io.load_json(path)
    if data.get("schema") != CALIBRATION_SCHEMA:
        raise InputError(
            f"{path}: schema {data.get('schema')!r}; this bench reads {CALIBRATION_SCHEMA}"
        )
    return dict(data.get("models", {}))


def save_models(models: dict[str, dict[str, Any]], path: Path = CALIBRATION_FILE) -> None:
    document = {
        "schema": CALIBRATION_SCHEMA,
        "about": "Static performance model (kernelgen.model.perfmodel.model_spec, and "
        "analytic_cost, the autotuner's ranking) of every spec timed in the prefill result files, "
        "computed from the templates each run measured; written by python -m bench.calibration. "
        "Keys: template hash (12 hex digits)/arch/spec uri.",
        "models": dict(sorted(models.items())),
    }
    write_atomic(path, to_json(document))


def model_entry(spec: Any, arch: str) -> dict[str, Any]:
    """The stored figures of one spec's model (compiles it: needs NVRTC)."""
    from kernelgen.model.perfmodel import analytic_cost, model_spec

    report = model_spec(spec, arch)
    unit, prediction = report.unit, report.prediction
    return {
        "uri": spec.uri,
        "arch": arch,
        "cost_clocks": prediction.cost,
        "limiter": prediction.limiter,
        "fraction_of_peak": prediction.fraction_of_peak,
        "clocks": prediction.clocks,
        "instructions": unit.instructions,
        "smem_kib": unit.smem_bytes / 1024,
        "registers": report.registers,
        "spill_bytes": report.spill_bytes,
        "blocks_per_sm": report.blocks_per_sm,
        "analytic_cost_clocks": analytic_cost(spec, arch),
    }


# The interior test of earlier tensor-core templates (kernelgen.model.perfmodel.INTERIOR holds
# today's): a run is modelled from the templates it measured, so the worker takes the set whose
# every test the rendered kernel contains exactly once.
EARLIER_INTERIOR = {
    "mma_sync": [
        {
            "exact = tile >= first_exact || mask != nullptr;": "exact = false;",
            "if (key0 + BLOCK_N <= num_keys) {": "if (true) {",
        }
    ]
}


def interior_for(source: str, mma: str) -> dict[str, str] | None:
    """The interior substitutions (today's, else an earlier template's) whose every test occurs
    exactly once in ``source``; None when none does."""
    from kernelgen.model import perfmodel as perfmodel

    for option in [perfmodel.INTERIOR[mma], *EARLIER_INTERIOR.get(mma, [])]:
        if all(source.count(test) == 1 for test in option):
            return option
    return None


def model_with_templates(spec: Any, arch: str) -> dict[str, Any]:
    """:func:`model_entry` with the interior test of the templates in use."""
    from kernelgen.kernels.render import render
    from kernelgen.model import perfmodel as perfmodel

    today = perfmodel.INTERIOR[spec.mma]
    found = interior_for(render(spec), spec.mma)
    if found is None:
        raise ValueError(f"{spec.uri}: no known interior test occurs once in its kernel")
    perfmodel.INTERIOR[spec.mma] = found
    try:
        return model_entry(spec, arch)
    finally:
        perfmodel.INTERIOR[spec.mma] = today


def worker(lines: Iterable[str], out: Any) -> None:
    """Model each ``{"key", "fields", "arch"}`` request line; one JSON line per spec on ``out``
    (``{"key", "entry"}`` or ``{"key", "error"}``). Runs under the requested templates."""
    from kernelgen.specs.forward import spec_from_dict

    for line in lines:
        if not line.strip():
            continue
        request = json.loads(line)
        try:
            spec = spec_from_dict(request["fields"])
            entry = model_with_templates(spec, request["arch"])
            reply: dict[str, Any] = {"key": request["key"], "entry": entry}
        except (KernelgenError, ValueError) as exc:
            reply = {"key": request["key"], "error": f"{type(exc).__name__}: {exc}"}
        out.write(json.dumps(reply) + "\n")
        out.flush()


def template_commit(measured: Sequence[MeasuredSpec], results_dir: Path) -> dict[str, str]:
    """{template hash: the commit whose templates a run with that hash measured}."""
    commits: dict[str, str] = {}
    for path in prefill_files(results_dir):
        data = results_io.load_prefill(path)
        origin = results_io.provenance(path, data["meta"])
        commits.setdefault(str(data["meta"].get("template_hash")), origin.commit)
    return {m.template_hash: commits[m.template_hash] for m in measured}


def export_templates(commit: str, dest: Path, root: Path = ROOT) -> Path:
    """``templates/`` of ``commit`` under ``dest`` (``git archive``); an InputError if git fails."""
    archive = subprocess.run(
        ["git", "archive", commit, "templates"], cwd=root, capture_output=True, check=False
    )
    if archive.returncode != 0:
        why = archive.stderr.decode(errors="replace").strip()
        raise InputError(f"commit {commit}: cannot export its templates ({why})")
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive.stdout, check=True)
    return dest / "templates"


def overlay_templates(commit_templates: Path, dest: Path) -> Path:
    """Today's templates with ``commit_templates`` copied over them: kernelgen renders only from
    a folder holding every template it knows, and an older commit lacks the newer families'
    (which the specs it measured do not render)."""
    import shutil

    folder = dest / "overlay"
    shutil.copytree(ROOT / "templates", folder)
    for path in commit_templates.iterdir():
        shutil.copy2(path, folder / path.name)
    return folder


def model_missing(
    measured: Sequence[MeasuredSpec],
    models: dict[str, dict[str, Any]],
    results_dir: Path = RESULTS_DIR,
    save: Any = save_models,
) -> dict[str, dict[str, Any]]:
    """Model every measured spec ``models`` lacks, one subprocess per template version; each
    finished spec is stored (``save``) as it arrives, so an interrupted run keeps its work."""
    todo: dict[str, dict[str, MeasuredSpec]] = {}
    for m in measured:
        if m.model_key not in models:
            todo.setdefault(m.template_hash, {})[m.model_key] = m
    from kernelgen.kernels.render import TEMPLATE_DIR_ENV, folder_hash

    commits = template_commit(measured, results_dir)
    for templates, specs in todo.items():
        commit = commits[templates]
        with tempfile.TemporaryDirectory() as tmp:
            exported = export_templates(commit, Path(tmp))
            if folder_hash(exported) != templates:
                print(
                    f"calibration: the templates of {commit[:7]} are not those measured "
                    f"(hash {templates[:12]}); {len(specs)} specs left unmodelled",
                    file=sys.stderr,
                )
                continue
            print(f"calibration: modelling {len(specs)} specs with the templates of {commit[:7]}")
            requests = "".join(
                json.dumps({"key": key, "fields": m.fields, "arch": m.arch}) + "\n"
                for key, m in specs.items()
            )
            folder = overlay_templates(exported, Path(tmp))
            env = {**os.environ, TEMPLATE_DIR_ENV: str(folder)}
            request_file = Path(tmp) / "requests.jsonl"  # a file: no pipe to fill both ways
            request_file.write_text(requests)
            with request_file.open() as stdin:
                proc = subprocess.Popen(
                    [sys.executable, "-m", "bench.calibration", "--worker"],
                    cwd=ROOT,
                    env=env,
                    stdin=stdin,
                    stdout=subprocess.PIPE,
                    text=True,
                )
            assert proc.stdout is not None
            for done, line in enumerate(proc.stdout, 1):
                reply = json.loads(line)
                entry = reply.get("entry") or {"error": reply["error"]}
                models[reply["key"]] = {**entry, "template_hash": templates, "commit": commit}
                print(
                    f"  [{done}/{len(specs)}] {reply['key']} {reply.get('error', '')}", flush=True
                )
                save(models)
            if proc.wait() != 0:
                raise InputError(f"the model worker for {commit[:7]} exited {proc.returncode}")
    return models


# ---- the comparison (pure: result files and stored predictions) -------------------------------
def ideal_clocks(head_dim: int) -> float:
    """Clocks one SM needs for a 64 x 64 unit's multiply-adds (two products of 64 x 64 x D) at
    the dense wgmma rate: the cost of a kernel that only ever waits on the tensor cores."""
    return 2 * 64 * 64 * head_dim / DENSE_MACS_PER_CLOCK


@dataclass(frozen=True)
class Calibrated:
    """One timed spec beside its stored prediction (``model`` None: not modelled)."""

    measured: MeasuredSpec
    model: dict[str, Any] | None

    @property
    def modelled(self) -> bool:
        return self.model is not None and "error" not in self.model

    @property
    def predicted_fraction(self) -> float | None:
        """The model's ceiling as a fraction of the dense (wgmma) tensor peak."""
        if not self.modelled:
            return None
        return ideal_clocks(self.measured.head_dim) / self.model["cost_clocks"]  # type: ignore[index]

    @property
    def measured_fraction(self) -> float | None:
        """Measured TFLOP/s over the run's measured matmul rate (the attainable dense peak)."""
        m = self.measured
        return m.tflops / m.matmul_tflops if m.tflops and m.matmul_tflops else None

    @property
    def efficiency(self) -> float | None:
        """Measured fraction over predicted fraction (1.0: the model's ceiling reached)."""
        measured, predicted = self.measured_fraction, self.predicted_fraction
        return measured / predicted if measured is not None and predicted else None


def calibrate(
    measured: Sequence[MeasuredSpec], models: dict[str, dict[str, Any]]
) -> list[Calibrated]:
    return [Calibrated(m, models.get(m.model_key)) for m in measured]


@dataclass(frozen=True)
class GroupFit:
    """How the model ranked one kernelgen row's candidates against their measured order:
    Spearman's correlation of the model's cost (``model_rho``) and of the autotuner's tiling-only
    cost (``tuner_rho``) with the measured median times, and how much slower than the measured
    best each one's first choice ran (1.0: it picked the fastest)."""

    file: str
    shape: str
    peer: str
    count: int
    model_rho: float | None
    tuner_rho: float | None
    best_label: str
    model_first: str
    model_first_slowdown: float
    tuner_first: str
    tuner_first_slowdown: float


def group_fits(calibrated: Sequence[Calibrated]) -> list[GroupFit]:
    """One :class:`GroupFit` per (file, shape, peer) with at least two modelled candidates."""
    groups: dict[tuple[str, str, str], list[Calibrated]] = {}
    for c in calibrated:
        if c.modelled:
            groups.setdefault((c.measured.file, c.measured.shape, c.measured.peer), []).append(c)
    fits = []
    for (file, shape, peer), members in groups.items():
        if len(members) < 2:
            continue
        times = [c.measured.median_ms for c in members]
        model = [c.model["cost_clocks"] for c in members]  # type: ignore[index]
        tuner = [c.model["analytic_cost_clocks"] for c in members]  # type: ignore[index]
        best = min(members, key=lambda c: c.measured.median_ms)
        # first choice: the lowest cost, ties to the candidate listed first (as the tuner)
        by_model = members[min(range(len(members)), key=lambda i: (model[i], i))]
        by_tuner = members[min(range(len(members)), key=lambda i: (tuner[i], i))]
        fits.append(
            GroupFit(
                file=file,
                shape=shape,
                peer=peer,
                count=len(members),
                model_rho=metrics.spearman(model, times),
                tuner_rho=metrics.spearman(tuner, times),
                best_label=best.measured.label,
                model_first=by_model.measured.label,
                model_first_slowdown=by_model.measured.median_ms / best.measured.median_ms,
                tuner_first=by_tuner.measured.label,
                tuner_first_slowdown=by_tuner.measured.median_ms / best.measured.median_ms,
            )
        )
    return fits


OVERLAP_SUFFIX = "-ovl"


@dataclass(frozen=True)
class OverlapPair:
    """A wgmma spec with intra-warpgroup overlap and the same tiling without, on one shape:
    measured TFLOP/s of each and the measured and predicted ratio (overlap over plain)."""

    file: str
    shape: str
    plain: Calibrated
    overlap: Calibrated

    @property
    def measured_ratio(self) -> float:
        return self.plain.measured.median_ms / self.overlap.measured.median_ms

    @property
    def predicted_ratio(self) -> float | None:
        if not (self.plain.modelled and self.overlap.modelled):
            return None
        return self.plain.model["cost_clocks"] / self.overlap.model["cost_clocks"]  # type: ignore[index]


def overlap_pairs(calibrated: Sequence[Calibrated]) -> list[OverlapPair]:
    """Every timed ``<label>-ovl`` candidate with its timed ``<label>`` on the same row."""
    by_label = {(c.measured.file, c.measured.shape, c.measured.label): c for c in calibrated}
    pairs = []
    for c in calibrated:
        m = c.measured
        if not m.label.endswith(OVERLAP_SUFFIX):
            continue
        plain = by_label.get((m.file, m.shape, m.label[: -len(OVERLAP_SUFFIX)]))
        if plain is not None:
            pairs.append(OverlapPair(m.file, m.shape, plain, c))
    return pairs


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m bench.calibration",
        description="Model every spec timed in the committed prefill result files (needs NVRTC) "
        "and store the predictions in bench/results/calibration.json.",
    )
    p.add_argument("--results", type=Path, default=RESULTS_DIR, help="result files' folder")
    p.add_argument("--out", type=Path, default=None, help="predictions file (default: in it)")
    p.add_argument(
        "--check", action="store_true", help="exit 1 if a timed spec has no stored prediction"
    )
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        worker(sys.stdin, sys.stdout)
        return 0
    out = args.out or args.results / CALIBRATION_FILE.name
    try:
        measured = all_measured(args.results)
        models = load_models(out)
        missing = sorted({m.model_key for m in measured} - models.keys())
        if args.check:
            for key in missing:
                print(f"calibration: no stored prediction for {key}", file=sys.stderr)
            return 1 if missing else 0
        model_missing(measured, models, args.results, lambda ms: save_models(ms, out))
    except InputError as exc:
        print(f"calibration: {exc}", file=sys.stderr)
        return 2
    print(f"calibration: {len(models)} stored predictions in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
