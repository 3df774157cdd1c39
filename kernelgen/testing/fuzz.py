"""A randomized differential sweep of the generated kernels through the CPU emulator.

Each case draws a valid spec and a problem (:mod:`kernelgen.testing.fuzz_space`; fp8 forward
specs :mod:`kernelgen.testing.fuzz_fp8`, backward specs :mod:`kernelgen.testing.fuzz_backward`),
runs the spec's generated CUDA on the emulator (hazard checks on) and compares the results with
float64 references under the test suite's limits (docs/design.md): a forward's out and lse with
:func:`kernelgen.references.attention.naive_attention` (:func:`mismatches`), an fp8 forward's with
:func:`kernelgen.references.fp8.fp8_reference` (:func:`fp8_mismatches`), a backward's dq, dk,
dv with :func:`kernelgen.references.attention.attention_backward` (:func:`grad_mismatches`).
Every case and every refused draw is one JSON line with a reproducer::

    python -m kernelgen.testing.fuzz --seed 1 --cases 50 --engine wgmma --out fuzz.jsonl
    python -m kernelgen.testing.fuzz --seed 1 --cases 50 --engine fp8
    python -m kernelgen.testing.fuzz --seed 1 --cases 50 --family backward --engine mma_sync
    python -m kernelgen.testing.fuzz --replay '<the "case" object of a line>'

docs/emulator.md ("Fuzzing the kernels") says what is drawn and how to read a report.
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
from kernelgen.families import spec_of_family
from kernelgen.references.attention import mismatches, naive_attention
from kernelgen.specs.forward import KernelSpec
from kernelgen.testing import fuzz_backward, fuzz_fp8
from kernelgen.testing.fuzz_inputs import call_arguments, draw_values
from kernelgen.testing.fuzz_space import (
    DrawStats,
    FuzzProblem,
    case_engine,
    case_rng,
    draw_problem,
    draw_spec,
)

ENGINES = ("wgmma", "mma_sync", "fp8", "all")  # the forward's (fp8: wgmma with float8_e4m3)
FAMILY_ENGINES = {"forward": ENGINES, "backward": fuzz_backward.ENGINES}
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


def draw_case(
    seed: int, index: int, engine: str, stats: DrawStats | None = None, family: str = "forward"
) -> tuple[FuzzCase, list[tuple[dict[str, Any], str]]]:
    """Case ``index`` of ``seed`` (deterministic) and the draws refused on the way to it."""
    rng = case_rng(seed, index)
    if family == "backward":
        fields, backward_spec, refused = fuzz_backward.draw_spec(rng, engine, stats)
        return FuzzCase(fields, fuzz_backward.draw_problem(rng, backward_spec)), refused
    fields, spec, refused = draw_spec(rng, case_engine(rng, engine), stats)
    problem = draw_problem(rng, spec)
    if spec.fp8:
        problem = fuzz_fp8.fit_problem(rng, problem)
    return FuzzCase(fields, problem), refused


def case_label(fields: dict[str, Any]) -> str:
    """What a case is counted under in the summary: its engine, ``fp8``, or ``backward/ENGINE``."""
    if fields.get("family") == "backward":
        return f"backward/{fields.get('mma', 'simt')}"
    return "fp8" if fields.get("dtype") == "float8_e4m3" else str(fields["mma"])


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


def make_inputs(spec: KernelSpec, p: FuzzProblem) -> Inputs:
    """Random inputs for ``p`` rounded to the spec's dtype, and the float64 reference of each
    batch entry over its own keys (the first seqlens_k[b])."""
    rng = np.random.default_rng(p.data_seed)
    d = spec.head_dim
    q = draw_values(rng, spec.dtype, p, p.batch, p.heads, p.seqlen_q, d)
    k = draw_values(rng, spec.dtype, p, p.batch, p.kv_heads, p.seqlen_k, d)
    v = draw_values(rng, spec.dtype, p, p.batch, p.kv_heads, p.seqlen_k, d)
    mask, keywords, hooks = call_arguments(rng, spec, p)
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
    any_spec = spec_of_family(case.spec)
    try:
        if not isinstance(any_spec, KernelSpec):
            return fuzz_backward.run(any_spec, case.problem)
        if any_spec.fp8:
            keywords, hooks = fuzz_fp8.call_keywords(any_spec, case.problem)
            return fuzz_fp8.run(any_spec, case.problem, keywords, hooks)
        return _run_forward(any_spec, case.problem)
    except EmulatorError as exc:
        return _raised("emulator_error", exc)
    except InputError as exc:
        return _raised("call_refused", exc)
    except (KernelgenError, ArithmeticError, LookupError, TypeError, ValueError) as exc:
        return _raised("crash", exc)


def _run_forward(spec: KernelSpec, p: FuzzProblem) -> dict[str, Any]:
    """A 16-bit forward case on the emulator, judged by :func:`compare`."""
    from kernelgen.calls.emulated import emulate_attention

    inputs = make_inputs(spec, p)  # a block-sparse spec's block mask is built here
    run = emulate_attention(
        spec, inputs.q, inputs.k, inputs.v, inputs.mask, layout=p.layout, scale=p.scale,
        num_splits=p.num_splits, page_size=p.page_size,
        seqlens_k=None if p.seqlens_k is None else np.array(p.seqlens_k, np.int32),
        want_lse=not p.null_lse, **inputs.keywords,
    )  # fmt: skip
    return compare(run.out, run.lse, inputs, spec.dtype)


def _raised(outcome: str, exc: BaseException) -> dict[str, Any]:
    message = str(exc).strip()
    return {"outcome": outcome, "error": type(exc).__name__, "message": message[:MESSAGE_CHARS]}


# ---- the sweep and its report --------------------------------------------------------------


def sweep(
    seed: int,
    cases: int,
    engine: str,
    budget: float | None,
    out: TextIO,
    family: str = "forward",
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
        case, refused = draw_case(seed, index, engine, stats, family)
        for fields, problem in refused:
            _write(out, {"seed": seed, "index": index, "outcome": "refused", "spec": fields,
                         "message": problem})  # fmt: skip
        began = time.monotonic()
        result = run_case(case)
        seconds = round(time.monotonic() - began, 2)
        line = {"seed": seed, "index": index, **result, "seconds": seconds,
                "case": json.loads(case.to_json()), "replay": replay_command(case)}  # fmt: skip
        _write(out, line)
        by_engine = counts.setdefault(case_label(case.spec), {})
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
        description="Randomized differential sweep of the kernels on the CPU emulator.",
    )
    parser.add_argument("--family", choices=tuple(FAMILY_ENGINES), default="forward",
                        help="forward (16-bit and fp8 specs) or backward specs")  # fmt: skip
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cases", type=int, default=20, help="cases to run (refusals aside)")
    parser.add_argument("--engine", default="all", help="forward: wgmma, mma_sync, fp8 (wgmma "
                        "with float8_e4m3) or all; backward: simt, mma_sync or all")  # fmt: skip
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
    if args.engine not in FAMILY_ENGINES[args.family]:
        parser.error(
            f"--engine={args.engine} is not allowed with --family={args.family}; use one of "
            f"{', '.join(FAMILY_ENGINES[args.family])}"
        )
    if args.replay is not None:
        try:
            case = FuzzCase.from_json(args.replay)
            spec_of_family(case.spec)
        except (ValueError, KeyError, TypeError) as exc:
            parser.error(f"--replay: not a case object ({type(exc).__name__}: {exc})")
        result = run_case(case)
        print(json.dumps({**result, "case": json.loads(case.to_json())}))
        return int(result["outcome"] in FAILURES)
    out = open(args.out, "w", encoding="utf-8") if args.out else sys.stdout  # noqa: SIM115
    failures = 0
    try:
        runs = sweep(args.seed, args.cases, args.engine, args.time_budget, out, args.family)
        for line in runs:
            if "summary" in line:
                print(json.dumps(line["summary"], indent=1), file=sys.stderr)
                continue
            failures += line["outcome"] in FAILURES
            print(f"case {line['index']}: {line['outcome']} ({line['seconds']} s) "
                  f"{spec_of_family(line['case']['spec']).uri}", file=sys.stderr)  # fmt: skip
            if line["outcome"] != "ok":
                print(f"  {line.get('failed') or line.get('message')}\n  {line['replay']}",
                      file=sys.stderr)  # fmt: skip
    finally:
        if out is not sys.stdout:
            out.close()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
