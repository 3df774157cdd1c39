"""``python -m bench.tuning``: the autotuner's three targets, measured on a GPU.

For each problem: (1) tune it cold and time ``select_launch`` on the host clock, in a fresh
Python process whose tuning database, compile memo and CuPy kernel cache start empty (CuPy reads
``CUPY_CACHE_DIR`` once, at import, and keeps every module it loaded in memory, so a cache
cleared inside a warm process is not cold); (2) re-time every candidate the tuner timed
on a longer budget (the exhaustive check) and compare the tuned winner with the best of them;
(3) on a small shape, the host time per call of a cached ``kernelgen.attention`` against calling
the same compiled kernel directly (``RuntimeKernel.__call__``, outputs preallocated).
Writes ``<out>/<date>-<gpu>-tuning.{json,md}``; ``--help`` and ``--list`` need no GPU.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench import report
from bench.attention import ROOT, git_info

# The autotuner's targets.
CHOICE_TOLERANCE = 1.03  # tuned winner within 3% of the exhaustive best
TUNE_SECONDS = 10.0  # one shape, compile caches cold
OVERHEAD_US = 15.0  # a cached attention() call over the direct launch
EXHAUSTIVE_BUDGET_MS = 300.0
OVERHEAD_CALLS = 2000


@dataclass(frozen=True)
class TuneShape:
    """One tuning problem: (B, H, Hkv, Sq, Sk, D), dtype, causal."""

    dtype: str
    batch: int
    heads: int
    kv_heads: int
    seqlen_q: int
    seqlen_k: int
    head_dim: int
    causal: bool = False

    @property
    def key(self) -> str:
        causal = "-causal" if self.causal else ""
        return (
            f"{self.dtype}-b{self.batch}-h{self.heads}kv{self.kv_heads}-q{self.seqlen_q}"
            f"-k{self.seqlen_k}-d{self.head_dim}{causal}"
        )

    @property
    def text(self) -> str:
        """``"B,H,HKV,SQ,SK,D"`` (what ``ProblemDesc.from_shape`` reads)."""
        return ",".join(
            str(x)
            for x in (
                self.batch,
                self.heads,
                self.kv_heads,
                self.seqlen_q,
                self.seqlen_k,
                self.head_dim,
            )
        )


QUICK: tuple[TuneShape, ...] = (
    TuneShape("bf16", 4, 16, 16, 4096, 4096, 128),
    TuneShape("bf16", 1, 32, 8, 1, 32768, 128),  # decode: split counts among the candidates
)
FULL: tuple[TuneShape, ...] = (
    *QUICK,
    TuneShape("bf16", 4, 16, 16, 4096, 4096, 128, causal=True),
    TuneShape("fp16", 16, 32, 32, 1024, 1024, 64),
    TuneShape("bf16", 2, 16, 4, 8192, 8192, 256, causal=True),
    TuneShape("fp16", 8, 32, 8, 1, 8192, 128),
)
OVERHEAD_SHAPE = TuneShape("fp16", 1, 8, 8, 128, 128, 64)


# ---- pure: verdicts and the table ------------------------------------------------------------
def choice_ratio(winner_ms: float | None, retimed: dict[str, float]) -> tuple[float | None, str]:
    """(tuned winner / exhaustive best, label of the best) from re-timed medians by label."""
    finite = {k: v for k, v in retimed.items() if v is not None and math.isfinite(v)}
    if winner_ms is None or not finite:
        return None, ""
    best = min(finite, key=lambda k: (finite[k], k))
    return winner_ms / finite[best], best


def verdict(value: float | None, limit: float) -> str:
    """PASS (value <= limit), MISS, or "not measured"."""
    if value is None or not math.isfinite(value):
        return "not measured"
    return "PASS" if value <= limit else "MISS"


def target_lines(rows: Sequence[dict[str, Any]], overhead: dict[str, Any] | None) -> list[str]:
    """One line per target, with the worst measured value."""

    def worst(field: str) -> float | None:
        values = [r[field] for r in rows if r.get(field) is not None]
        return max(values) if values else None

    ratio, seconds = worst("choice_ratio"), worst("tune_s")
    extra = (overhead or {}).get("overhead_us")
    shown = {
        "ratio": f"{ratio:.3f}" if ratio else "-",
        "tune": f"{seconds:.1f} s" if seconds else "-",
        "extra": f"{extra:.1f} us" if extra is not None else "-",
    }
    return [
        f"- {verdict(ratio, CHOICE_TOLERANCE)}: tuned choice within 3% of the exhaustive best "
        f"(worst ratio {shown['ratio']} over {len(rows)} shapes)",
        f"- {verdict(seconds, TUNE_SECONDS)}: tuning one shape under {TUNE_SECONDS:g} s, "
        f"compile caches cold (slowest {shown['tune']})",
        f"- {verdict(extra, OVERHEAD_US)}: a cached attention() call adds under "
        f"{OVERHEAD_US:g} us over the direct launch (measured {shown['extra']})",
    ]


def markdown_document(result: dict[str, Any]) -> str:
    rows, overhead = result["rows"], result.get("overhead")
    lines = [f"# Autotuner targets, {result['meta'].get('gpu_name')}, {result['meta']['date']}"]
    lines += ["", *report.provenance(result["meta"]), ""]
    header = ["shape", "tune s", "candidates", "winner", "winner ms", "best (exhaustive)", "ratio"]
    table = [
        [
            r["shape"],
            f"{r['tune_s']:.1f}" if r.get("tune_s") is not None else "-",
            str(r.get("timed", "-")),
            r.get("winner", r.get("reason", "-")),
            f"{r['winner_ms']:.4f}" if r.get("winner_ms") else "-",
            r.get("best", "-") or "-",
            f"{r['choice_ratio']:.3f}" if r.get("choice_ratio") else "-",
        ]
        for r in rows
    ]
    align = ["---", "---:", "---:", "---", "---:", "---", "---:"]
    lines.append(report.md_table(header, table, align))
    if overhead:
        lines += [
            "",
            f"Cached call ({overhead['shape']}): attention() {overhead['attention_us']:.1f} us, "
            f"direct launch {overhead['direct_us']:.1f} us per call (host clock, "
            f"{overhead['calls']} calls each, median of {overhead['rounds']} rounds): "
            f"+{overhead['overhead_us']:.1f} us.",
        ]
    lines += ["", "## Targets", "", *target_lines(rows, overhead), ""]
    return "\n".join(lines)


# ---- cold tuning, in a child process ----------------------------------------------------------
def cold_environment(root: Path) -> dict[str, str]:
    """The child's environment: the tuning database, compile memo and CuPy's kernel cache in
    empty folders under ``root``, autotuning on."""
    return {
        **os.environ,
        "KERNELGEN_CACHE_DIR": str(root / "kernelgen"),
        "CUPY_CACHE_DIR": str(root / "cupy"),
        "KERNELGEN_AUTOTUNE": "1",
    }


def cold_tune(shape: TuneShape, root: Path) -> dict[str, Any]:
    """``python -m bench.tuning --cold-tune SHAPE`` in a fresh process with empty caches under
    ``root``: {"tune_s", "winner"}; the record it wrote stays under ``root``."""
    done = subprocess.run(
        [sys.executable, "-m", "bench.tuning", "--cold-tune", json.dumps(vars(shape))],
        env=cold_environment(root),
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"cold tuning exited {done.returncode}: {last}")
    return json.loads(lines[-1])


def cold_tune_here(shape: TuneShape) -> dict[str, Any]:
    """The child's side: the CUDA context made first (not a tuning cost), then
    ``select_launch`` on the host clock."""
    import cupy

    from kernelgen.tuning import ProblemDesc, select_launch
    from kernelgen.tuning.gpu import detect_device

    problem = ProblemDesc.from_shape(shape.text, shape.dtype, shape.causal)
    device = detect_device()
    cupy.empty(1)
    cupy.cuda.get_current_stream().synchronize()
    start = time.perf_counter()
    launch = select_launch(problem, device)
    return {"tune_s": time.perf_counter() - start, "winner": launch.label}


# ---- the GPU layer -------------------------------------------------------------------------
def tune_row(shape: TuneShape, scratch: Path) -> dict[str, Any]:
    """Cold tuning time (a fresh process), the record, and the exhaustive re-timing of its
    candidates (here)."""
    from kernelgen.specs.forward import spec_from_dict
    from kernelgen.tuning import ProblemDesc, TuningDB, make_key
    from kernelgen.tuning.candidates import TunedLaunch
    from kernelgen.tuning.gpu import CupyBench, detect_device
    from kernelgen.tuning.measure import MeasureSettings

    root = scratch / shape.key
    cold = cold_tune(shape, root)
    problem = ProblemDesc.from_shape(shape.text, shape.dtype, shape.causal)
    device = detect_device()
    record = TuningDB(root / "kernelgen").load(make_key(problem, device))
    assert record is not None, "the tuner wrote no record"
    bench = CupyBench(problem, device, seed=1)
    retimed: dict[str, float] = {}
    for c in record.candidates:
        if c.get("median_ms") is None:
            continue
        candidate = TunedLaunch(spec_from_dict(c["spec"]), c.get("num_splits"))
        samples = bench.time(
            candidate.spec,
            EXHAUSTIVE_BUDGET_MS,
            candidate.num_splits,
            min_reps=MeasureSettings().min_reps,  # as many as the tuner's own full pass
        )
        retimed[candidate.label] = statistics.median(samples)
    winner_ms = retimed.get(cold["winner"])
    ratio, best = choice_ratio(winner_ms, retimed)
    return {
        "shape": shape.key,
        **vars(shape),
        "tune_s": round(cold["tune_s"], 3),
        "timed": len(retimed),
        "dropped": len(record.dropped),
        "winner": cold["winner"],
        "winner_ms": winner_ms,
        "best": best,
        "best_ms": retimed.get(best),
        "choice_ratio": ratio,
        "retimed_ms": retimed,
    }


def per_call_us(call: Callable[[], Any], sync: Callable[[], None], calls: int) -> float:
    """Host microseconds per call over ``calls`` back-to-back calls (then one sync)."""
    sync()
    start = time.perf_counter()
    for _ in range(calls):
        call()
    elapsed = time.perf_counter() - start
    sync()
    return elapsed / calls * 1e6


def overhead_row(shape: TuneShape, rounds: int = 5) -> dict[str, Any]:
    """attention() with a memo hit against RuntimeKernel.__call__ on the same spec and
    buffers: host time per call (a kernel this small finishes before the next enqueue)."""
    import cupy

    import kernelgen
    from kernelgen.runtime.launch import runtime_kernel
    from kernelgen.tuning import ProblemDesc, select_launch
    from kernelgen.tuning.candidates import launch_problem
    from kernelgen.tuning.gpu import element_dtype

    problem = ProblemDesc.from_shape(shape.text, shape.dtype, shape.causal)
    dtype = element_dtype(problem.dtype)
    q = cupy.random.standard_normal((shape.batch, shape.heads, shape.seqlen_q, shape.head_dim))
    k = cupy.random.standard_normal((shape.batch, shape.kv_heads, shape.seqlen_k, shape.head_dim))
    q, k = q.astype(dtype), k.astype(dtype)
    v = k.copy()
    kernelgen.attention(q, k, v)  # tunes (or reads) once: the calls below hit the memo
    launch = select_launch(problem)
    kernel = runtime_kernel(launch.spec)
    tensors = {"q": q, "k": k, "v": v, "out": cupy.empty_like(q)}
    tensors["lse"] = cupy.empty(q.shape[:3], cupy.float32)
    lp, scale = launch_problem(problem), 1.0 / math.sqrt(shape.head_dim)
    sync = cupy.cuda.get_current_stream().synchronize
    timings = {"attention": [], "direct": []}
    for _ in range(rounds):
        timings["attention"].append(
            per_call_us(lambda: kernelgen.attention(q, k, v), sync, OVERHEAD_CALLS)
        )
        timings["direct"].append(
            per_call_us(lambda: kernel(tensors, lp, scale, launch.num_splits), sync, OVERHEAD_CALLS)
        )
    attention_us = statistics.median(timings["attention"])
    direct_us = statistics.median(timings["direct"])
    return {
        "shape": shape.key,
        "spec": launch.label,
        "attention_us": attention_us,
        "direct_us": direct_us,
        "overhead_us": attention_us - direct_us,
        "calls": OVERHEAD_CALLS,
        "rounds": rounds,
        "all_us": timings,
    }


def run(args: argparse.Namespace, shapes: Sequence[TuneShape]) -> int:
    from kernelgen.errors import KernelgenError
    from kernelgen.kernels.render import template_hash
    from kernelgen.tuning.gpu import detect_device, detect_software

    try:
        device, software = detect_device(), detect_software()
    except KernelgenError as exc:
        print(f"bench: no usable GPU: {str(exc).splitlines()[0]}", file=sys.stderr)
        return 2
    today = dt.date.today()
    meta = {
        "date": today.isoformat(),
        "benchmark": "tuning",
        "gpu_name": device.name,
        "compute_capability": device.compute_capability,
        "sm_count": device.sm_count,
        **vars(software),
        "template_hash": template_hash(),
        **git_info(),
    }
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="kg-tuning-bench-") as tmp:
        # this process's own tuning (the overhead shape) stays out of the user's cache too
        os.environ.update(KERNELGEN_CACHE_DIR=str(Path(tmp) / "main"), KERNELGEN_AUTOTUNE="1")
        for shape in shapes:
            try:
                rows.append(tune_row(shape, Path(tmp)))
            except Exception as exc:  # recorded, the next shape goes on
                rows.append({"shape": shape.key, "reason": f"{type(exc).__name__}: {exc}"[:300]})
            print(
                f"{rows[-1]['shape']:40} {rows[-1].get('tune_s', '-')} s  "
                f"ratio {rows[-1].get('choice_ratio')}",
                flush=True,
            )
        overhead = None
        if not args.no_overhead:
            try:
                overhead = overhead_row(OVERHEAD_SHAPE)
            except Exception as exc:
                print(f"bench: overhead measurement failed: {exc}", file=sys.stderr)
    result = {"meta": meta, "rows": rows, "overhead": overhead}
    stem = report.result_stem(today, device.name, "tuning")
    paths = report.result_paths(args.out, stem)
    report.write_atomic(paths["json"], report.to_json(result))
    report.write_atomic(paths["md"], markdown_document(result))
    print(f"wrote {paths['json']}\n")
    print("\n".join(target_lines(rows, overhead)))
    return 0


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m bench.tuning",
        description="The autotuner's targets: cold tuning time per shape, tuned choice against "
        "an exhaustive re-timing of its candidates, cached attention() overhead.",
    )
    p.add_argument("--quick", action="store_true", help=f"{len(QUICK)} shapes (else {len(FULL)})")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results", help="results folder")
    p.add_argument("--no-overhead", action="store_true", help="skip the cached-call measurement")
    p.add_argument("--list", action="store_true", help="print the shapes, then exit")
    p.add_argument("--cold-tune", metavar="SHAPE_JSON", help=argparse.SUPPRESS)  # the child
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.cold_tune:
        print(json.dumps(cold_tune_here(TuneShape(**json.loads(args.cold_tune)))))
        return 0
    shapes = QUICK if args.quick else FULL
    if args.list:
        for s in shapes:
            print(f"  {s.key}  ({s.text}, {s.dtype}{', causal' if s.causal else ''})")
        print(f"overhead: {OVERHEAD_SHAPE.key}")
        return 0
    return run(args, shapes)


if __name__ == "__main__":
    sys.exit(main())
