"""A randomized differential sweep of the forward kernels through the CPU emulator.

Each case draws a valid forward spec and a problem (:mod:`kernelgen.testing.fuzz_space`), runs
the spec's generated CUDA on the emulator (hazard checks on) through
:func:`kernelgen.calls.emulated.emulate_attention`, and compares out and lse with the float64
reference (:func:`kernelgen.references.attention.naive_attention`) under the test suite's
limits (docs/design.md). Every case and every refused draw is one JSON line with a reproducer::

    python -m kernelgen.testing.fuzz --seed 1 --cases 50 --engine wgmma --out fuzz.jsonl
    python -m kernelgen.testing.fuzz --replay '<the "case" object of a line>'

docs/emulator.md ("Fuzzing the forward kernels") says what is drawn and how to read a report.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, TextIO

import numpy as np

from kernelgen.errors import EmulatorError, InputError, KernelgenError
from kernelgen.references.attention import mismatches, naive_attention
from kernelgen.references.example_inputs import ProblemSizes, expression_arguments
from kernelgen.runtime.emulated_launch import from_device_dtype, to_device_dtype
from kernelgen.specs.forward import KernelSpec, spec_from_dict
from kernelgen.testing.fuzz_space import (
    EMPTY_DOC,
    DrawStats,
    FuzzProblem,
    case_engine,
    case_rng,
    draw_problem,
    draw_spec,
)

ENGINES = ("wgmma", "mma_sync", "all")
MESSAGE_CHARS = 600  # an error's message in a report line is cut to this
# Outcomes of a case: the kernels agree with float64 (ok), disagree (mismatch), the emulator
# raised (a hazard, a deadlock, a launch error), the call refused the problem (call_refused:
# an InputError of kernelgen's checks), or something else raised (crash); refused: a spec draw
# the validator refused (no run).
OUTCOMES = ("ok", "mismatch", "emulator_error", "call_refused", "crash", "refused")
FAILURES = ("mismatch", "emulator_error", "crash")  # what makes the command exit 1


@dataclass(frozen=True)
class FuzzCase:
    """A drawn spec's fields and a problem: everything a run needs (``--replay`` takes its
    JSON)."""

    spec: dict[str, Any]
    problem: FuzzProblem

    def to_json(self) -> str:
        return json.dumps(
            {"spec": self.spec, "problem": self.problem.to_dict()}, separators=(",", ":")
        )

    @classmethod
    def from_json(cls, text: str) -> FuzzCase:
        data = json.loads(text)
        return cls(dict(data["spec"]), FuzzProblem.from_dict(data["problem"]))


def draw_case(seed: int, index: int, engine: str, stats: DrawStats | None = None) -> tuple[
    FuzzCase, list[tuple[dict[str, Any], str]]
]:  # fmt: skip
    """Case ``index`` of ``seed`` (deterministic) and the draws refused on the way to it."""
    rng = case_rng(seed, index)
    fields, spec, refused = draw_spec(rng, case_engine(rng, engine), stats)
    return FuzzCase(fields, draw_problem(rng, spec)), refused


def replay_command(case: FuzzCase) -> str:
    return f"python -m kernelgen.testing.fuzz --replay '{case.to_json()}'"


# ---- inputs and the reference --------------------------------------------------------------


@dataclass
class Inputs:
    """A case's float32 inputs (dtype-exact values, NaN past the lengths when asked), the
    emulate_attention keywords of its variants and expressions, and the float64 reference."""

    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    mask: np.ndarray | None
    keywords: dict[str, Any]
    ref_out: np.ndarray
    ref_lse: np.ndarray


def _rounded(x: np.ndarray, dtype: str) -> np.ndarray:
    return from_device_dtype(to_device_dtype(np.asarray(x, np.float32), dtype), dtype)


def _documents(rng: np.random.Generator, p: FuzzProblem) -> dict[str, np.ndarray]:
    """Document ids of keys (B, Sk: sorted, up to 4 documents) and queries (B, Sq: the
    document of the key each aligns with, bottom right; before the first key, or in a random
    stretch, :data:`EMPTY_DOC`)."""
    kdoc = np.sort(rng.integers(0, 4, (p.batch, p.seqlen_k)), axis=1).astype(np.int32)
    qdoc = np.full((p.batch, p.seqlen_q), EMPTY_DOC, np.int32)
    aligned = np.arange(p.seqlen_q) + p.seqlen_k - p.seqlen_q
    seen = aligned >= 0
    qdoc[:, seen] = kdoc[:, aligned[seen]]
    if p.seqlen_q > 8 and rng.random() < 0.3:
        start = int(rng.integers(p.seqlen_q - 8))
        qdoc[:, start : start + int(rng.integers(1, 70))] = EMPTY_DOC
    return {"qdoc": qdoc, "kdoc": kdoc}


def _variant_keywords(rng: np.random.Generator, spec: KernelSpec, p: FuzzProblem) -> dict:
    keywords: dict[str, Any] = {}
    if spec.window:
        keywords["window_size"] = p.window
    if spec.softcap:
        keywords["softcap"] = p.softcap
    if spec.alibi:
        shape = (p.batch, p.heads) if p.alibi_per_batch else (p.heads,)
        keywords["alibi_slopes"] = rng.uniform(0.01, 0.5, shape).astype(np.float32)
    if spec.sinks:
        keywords["sinks"] = (2 * rng.standard_normal(p.heads)).astype(np.float32)
    return keywords


def make_inputs(spec: KernelSpec, p: FuzzProblem) -> Inputs:
    """Random inputs for ``p`` rounded to the spec's dtype, and the float64 reference of each
    batch entry over its own keys (the first seqlens_k[b])."""
    rng = np.random.default_rng(p.data_seed)
    d = spec.head_dim

    def draw(*shape: int) -> np.ndarray:
        x = rng.standard_normal(shape)
        if p.wide_range:  # rows scaled by 2^-4 .. 2^4: scores far apart, values of all sizes
            x = x * np.exp2(rng.integers(-4, 5, shape[:-1]))[..., None]
        return _rounded(x, spec.dtype)

    q = draw(p.batch, p.heads, p.seqlen_q, d)
    k = draw(p.batch, p.kv_heads, p.seqlen_k, d)
    v = draw(p.batch, p.kv_heads, p.seqlen_k, d)
    mask = None
    if p.mask == "broadcast":  # empty rows and rows that lose every other key
        mask = rng.standard_normal((1, p.heads, p.seqlen_q, p.seqlen_k)).astype(np.float32)
        mask[:, :, ::5, :] = -np.inf
        mask[:, :, 1::3, ::2] = -np.inf
    elif p.mask == "full":
        shape = (p.batch, p.heads, p.seqlen_q, p.seqlen_k)
        mask = (2 * rng.standard_normal(shape)).astype(np.float32)
    keywords = _variant_keywords(rng, spec, p)
    hooks: dict[str, Any] = {}
    if spec.has_expressions:
        inputs = _documents(rng, p) if spec.mask_mod is not None else {}
        sizes = ProblemSizes(p.batch, p.heads, p.seqlen_q, p.seqlen_k)
        expressions, hooks = expression_arguments(spec, sizes, inputs)
        keywords |= expressions
    lengths = p.seqlens_k or (p.seqlen_k,) * p.batch
    ref_out, ref_lse = _reference(spec, p, q, k, v, mask, keywords, hooks, lengths)
    if p.nan_past:
        k, v = k.copy(), v.copy()
        for b, n in enumerate(lengths):
            k[b, :, n:] = np.nan
            v[b, :, n:] = np.nan
    return Inputs(q, k, v, mask, keywords, ref_out, ref_lse)


def _reference(
    spec: KernelSpec,
    p: FuzzProblem,
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    mask: np.ndarray | None,
    keywords: dict[str, Any],
    hooks: dict[str, Any],
    lengths: tuple[int, ...],
) -> tuple[np.ndarray, np.ndarray]:
    """float64 out and lse, entry by entry over its first lengths[b] keys (causal and windows
    aligned to that length; the expression hooks see the entry's own batch index)."""
    variants = {
        name: keywords[name] for name in ("window_size", "softcap", "sinks") if name in keywords
    }
    slopes = keywords.get("alibi_slopes")
    shape = (p.batch, p.heads, p.seqlen_q, p.seqlen_k)
    full_mask = None if mask is None else np.broadcast_to(mask, shape)
    outs, lses = [], []
    for b, n in enumerate(lengths):
        entry = dict(variants)
        if slopes is not None:
            entry["alibi_slopes"] = slopes[b] if slopes.ndim == 2 else slopes
        if "score_mod" in hooks:
            entry["score_mod"] = lambda s, bb, h, i, j, b=b: hooks["score_mod"](s, bb + b, h, i, j)
        if "mask_mod" in hooks:
            entry["mask_mod"] = lambda bb, h, i, j, b=b: hooks["mask_mod"](bb + b, h, i, j)
        out, lse = naive_attention(
            q[b : b + 1], k[b : b + 1, :, :n], v[b : b + 1, :, :n], causal=spec.causal,
            scale=p.scale, mask=None if full_mask is None else full_mask[b : b + 1, :, :, :n],
            **entry,
        )  # fmt: skip
        outs.append(out)
        lses.append(lse)
    return np.concatenate(outs), np.concatenate(lses)


# ---- a run and its judgement ---------------------------------------------------------------


def compare(out: np.ndarray, lse: np.ndarray | None, inputs: Inputs, dtype: str) -> dict[str, Any]:
    """The test suite's checks (kernelgen.references.attention.mismatches) as a verdict:
    ``{"outcome": "ok" | "mismatch", "out_error", "lse_error", "failed": [...]}`` (lse None:
    a call that asked for none; out alone is judged)."""
    found = mismatches(out, lse, inputs.ref_out, inputs.ref_lse, dtype)
    return _verdict(list(found.failed), found.out_error, found.lse_error)


def _verdict(failed: list[str], error: float, lse_error: float) -> dict[str, Any]:
    return {
        "outcome": "mismatch" if failed else "ok",
        "out_error": float(f"{error:.4g}"),
        "lse_error": float(f"{lse_error:.4g}"),
        **({"failed": failed} if failed else {}),
    }


def run_case(case: FuzzCase) -> dict[str, Any]:
    """Run one case on the emulator and judge it: a dict with ``outcome`` (:data:`OUTCOMES`)
    and the errors or the exception's type and message."""
    from kernelgen.calls.emulated import emulate_attention

    spec = spec_from_dict(case.spec)
    p = case.problem
    try:
        inputs = make_inputs(spec, p)  # a block-sparse spec's block mask is built here
        run = emulate_attention(
            spec, inputs.q, inputs.k, inputs.v, inputs.mask, layout=p.layout, scale=p.scale,
            num_splits=p.num_splits, page_size=p.page_size,
            seqlens_k=None if p.seqlens_k is None else np.array(p.seqlens_k, np.int32),
            want_lse=not p.null_lse, **inputs.keywords,
        )  # fmt: skip
    except EmulatorError as exc:
        return _raised("emulator_error", exc)
    except InputError as exc:
        return _raised("call_refused", exc)
    except (KernelgenError, ArithmeticError, LookupError, TypeError, ValueError) as exc:
        return _raised("crash", exc)
    return compare(run.out, run.lse, inputs, spec.dtype)


def _raised(outcome: str, exc: BaseException) -> dict[str, Any]:
    message = str(exc).strip()
    return {"outcome": outcome, "error": type(exc).__name__, "message": message[:MESSAGE_CHARS]}


# ---- the sweep and its report --------------------------------------------------------------


def sweep(
    seed: int, cases: int, engine: str, budget: float | None, out: TextIO
) -> Iterator[dict[str, Any]]:
    """Run cases 0.. of ``seed`` until ``cases`` ran or ``budget`` seconds passed, writing one
    JSON line per case and per refused draw to ``out``; yields each run's line; the last yield
    is the summary (``{"summary": ...}``)."""
    stats = DrawStats.empty()
    counts: dict[str, dict[str, int]] = {}
    start = time.monotonic()
    for index in range(cases):
        if budget is not None and time.monotonic() - start > budget:
            break
        case, refused = draw_case(seed, index, engine, stats)
        for fields, problem in refused:
            _write(out, {"seed": seed, "index": index, "outcome": "refused", "spec": fields,
                         "message": problem})  # fmt: skip
        began = time.monotonic()
        result = run_case(case)
        seconds = round(time.monotonic() - began, 2)
        line = {"seed": seed, "index": index, **result, "seconds": seconds,
                "case": json.loads(case.to_json()), "replay": replay_command(case)}  # fmt: skip
        _write(out, line)
        by_engine = counts.setdefault(case.spec["mma"], {})
        by_engine[result["outcome"]] = by_engine.get(result["outcome"], 0) + 1
        yield line
    yield {"summary": {"cases": counts, "refusal_rate": stats.rates(), "blamed": stats.blamed,
                       "seconds": round(time.monotonic() - start, 1)}}  # fmt: skip


def _write(out: TextIO, line: dict[str, Any]) -> None:
    out.write(json.dumps(line, separators=(",", ":")) + "\n")
    out.flush()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m kernelgen.testing.fuzz",
        description="Randomized differential sweep of the forward kernels on the CPU emulator.",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cases", type=int, default=20, help="cases to run (refusals aside)")
    parser.add_argument("--engine", choices=ENGINES, default="all")
    parser.add_argument("--time-budget", type=float, default=None, metavar="SECONDS",
                        help="start no case after this many seconds")  # fmt: skip
    parser.add_argument("--out", default=None, help="JSON lines file (default: stdout)")
    parser.add_argument("--replay", default=None, metavar="JSON",
                        help="run one case: the 'case' object of a report line")  # fmt: skip
    args = parser.parse_args(argv)
    if args.cases < 0 or (args.time_budget is not None and args.time_budget <= 0):
        parser.error(
            f"--cases={args.cases}, --time-budget={args.time_budget}: use a count >= 0 and a "
            "budget > 0 seconds"
        )
    if args.replay is not None:
        try:
            case = FuzzCase.from_json(args.replay)
        except (ValueError, KeyError, TypeError) as exc:
            parser.error(f"--replay: not a case object ({type(exc).__name__}: {exc})")
        result = run_case(case)
        print(json.dumps({**result, "case": json.loads(case.to_json())}))
        return int(result["outcome"] in FAILURES)
    out = open(args.out, "w", encoding="utf-8") if args.out else sys.stdout  # noqa: SIM115
    failures = 0
    try:
        for line in sweep(args.seed, args.cases, args.engine, args.time_budget, out):
            if "summary" in line:
                print(json.dumps(line["summary"], indent=1), file=sys.stderr)
                continue
            failures += line["outcome"] in FAILURES
            print(f"case {line['index']}: {line['outcome']} ({line['seconds']} s) "
                  f"{spec_from_dict(line['case']['spec']).uri}", file=sys.stderr)  # fmt: skip
            if line["outcome"] != "ok":
                print(f"  {line.get('failed') or line.get('message')}\n  {line['replay']}",
                      file=sys.stderr)  # fmt: skip
    finally:
        if out is not sys.stdout:
            out.close()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
