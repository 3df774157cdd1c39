"""The autotuner's one flow: key -> memo -> disk -> (lock, re-check) -> tune -> record -> launch.

Controls (environment): ``KERNELGEN_AUTOTUNE`` = ``1`` (default: tune on a miss), ``0`` (no
tuning, no database: the heuristic default spec) or ``offline`` (database only: a miss raises
:class:`TuningMissError`); ``KERNELGEN_PRINT_AUTOTUNING=1`` prints each key and its winner.
"""

from __future__ import annotations

import datetime as _dt
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any, Literal

from kernelgen.errors import KernelgenError, SpecError
from kernelgen.families import AnySpec, family_of, spec_of_family
from kernelgen.model.policy import (
    HOPPER_DEVICE_ARCH,
    default_backward_spec,
    default_spec,
    fp8_decode_spec,
    fp8_default_spec,
    hopper_default_spec,
)
from kernelgen.specs.arch import ARCHS
from kernelgen.tuning.candidates import (
    CompileFn,
    TunedLaunch,
    decode_rows,
    fp8_decode_problem,
    prune,
)
from kernelgen.tuning.db import TuningDB, TuningRecord
from kernelgen.tuning.key import DeviceInfo, ProblemDesc, SoftwareInfo, TuningKey
from kernelgen.tuning.measure import Bench, MeasureSettings, measure

log = logging.getLogger(__name__)

Mode = Literal["on", "off", "offline"]
Tuner = Callable[[ProblemDesc, TuningKey], TuningRecord]
BenchFactory = Callable[[ProblemDesc, DeviceInfo], Bench]

_MEMO: dict[TuningKey, TunedLaunch] = {}
_MEMO_LOCK = threading.Lock()
_MEMO_GENERATION = [0]  # bumped whenever the memo changes; attention()'s call plans key on it


def memo_generation() -> int:
    """A number that changes whenever the memo does (a new winner, or a clear)."""
    return _MEMO_GENERATION[0]


class TuningMissError(KernelgenError, LookupError):
    """Offline mode found no tuning record for a key (tune it, or import a database)."""


class TuningFailedError(KernelgenError, RuntimeError):
    """Every candidate was pruned, failed or produced wrong output."""


def autotune_mode(mode: str | None = None) -> Mode:
    """``mode`` if given, else from ``KERNELGEN_AUTOTUNE`` (1/on, 0/off, offline)."""
    value = (mode if mode is not None else os.environ.get("KERNELGEN_AUTOTUNE", "1")).lower()
    table: dict[str, Mode] = {
        "1": "on", "on": "on", "true": "on", "": "on",
        "0": "off", "off": "off", "false": "off",
        "offline": "offline",
    }  # fmt: skip
    if value not in table:
        raise KernelgenError(f"KERNELGEN_AUTOTUNE={value!r} is not allowed; use 1, 0 or offline")
    return table[value]


def heuristic_spec(problem: ProblemDesc, device: DeviceInfo) -> AnySpec:
    """The spec attention() uses without tuning: on a 9.0 device, the Hopper kernel for a
    prefill problem it takes (kernelgen.model.policy.hopper_default_spec: no mask, no paged cache);
    else kernelgen.model.policy.default_spec (the split-KV decode kernel for decode problems). For a
    backward problem, what attention_backward() uses:
    kernelgen.model.policy.default_backward_spec; for an fp8 problem, the plain fp8 loop
    (kernelgen.model.policy.fp8_default_spec) on any device, for an fp8 decode or paged one the
    fp8 decode spec (kernelgen.model.policy.fp8_decode_spec)."""
    if problem.family == "backward":
        return default_backward_spec(
            problem.dtype,
            problem.head_dim,
            causal=problem.causal,
            variants=problem.variants,
            deterministic=problem.deterministic,
            additive_mask=problem.mask,
            tensor_cores=ARCHS[device.target_arch].compute_capability >= 80,
            arch=device.target_arch,
        )
    if problem.fp8 and fp8_decode_problem(problem):
        return fp8_decode_spec(
            problem.head_dim, problem.causal, problem.gqa_ratio, problem.variants,
            paged_kv=problem.page_size > 0,
        )  # fmt: skip
    if problem.fp8:
        return fp8_default_spec(problem.head_dim, problem.causal, problem.variants)
    prefill = decode_rows(problem) is None and not problem.mask and problem.page_size == 0
    if prefill and device.target_arch == HOPPER_DEVICE_ARCH:
        hopper = hopper_default_spec(
            problem.dtype, problem.head_dim, problem.causal, problem.variants
        )
        if hopper is not None:
            return hopper
    return default_spec(
        problem.dtype,
        problem.head_dim,
        problem.causal,
        device.target_arch,
        decode_rows=decode_rows(problem),
        paged_kv=problem.page_size > 0,
        variants=problem.variants,
        additive_mask=problem.mask,
    )


def make_key(
    problem: ProblemDesc, device: DeviceInfo, software: SoftwareInfo | None = None
) -> TuningKey:
    if software is None:
        from kernelgen.tuning.gpu import detect_software

        software = detect_software()
    return TuningKey(problem.bucket(), device, software)


def tune_problem(
    problem: ProblemDesc,
    key: TuningKey,
    bench: Bench,
    *,
    compile_fn: CompileFn | None = None,
    settings: MeasureSettings | None = None,
) -> TuningRecord:
    """Prune statically, time the survivors with ``bench``, and build the record."""
    candidates, dropped = prune(problem, key.device, compile_fn)
    if not candidates:
        raise TuningFailedError(f"every candidate for {key.problem.label} was pruned")
    winner, results = measure([c.launch for c in candidates], bench, settings)
    if winner is None:
        reasons = "; ".join(f"{m.launch.label}: {m.reason}" for m in results[:3])
        raise TuningFailedError(f"no candidate for {key.problem.label} ran correctly ({reasons})")
    return TuningRecord(
        key=key,
        winner=winner.spec.model_dump(mode="json"),
        winner_launch={"num_splits": winner.num_splits},
        candidates=[m.as_dict() for m in results],
        dropped=[{"uri": d.uri, "stage": d.stage, "reason": d.reason} for d in dropped],
        tuned_shape={
            "batch": problem.batch,
            "num_heads": problem.num_heads,
            "num_kv_heads": problem.num_kv_heads,
            "seqlen_q": problem.seqlen_q,
            "seqlen_k": problem.seqlen_k,
            "head_dim": problem.head_dim,
        },
        created=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    )


def bench_for(problem: ProblemDesc, device: DeviceInfo) -> Bench:
    """The bench that times ``problem``'s candidates on the current GPU: the backward's
    (:class:`kernelgen.tuning.gpu.BackwardBench`), the fp8 forward's (torch e4m3 inputs:
    :class:`kernelgen.tuning.fp8_bench.Fp8Bench`) or the forward's
    (:class:`kernelgen.tuning.gpu.CupyBench`)."""
    from kernelgen.tuning import gpu

    if problem.family == "backward":
        return gpu.BackwardBench(problem, device)
    if problem.fp8:
        from kernelgen.tuning.fp8_bench import Fp8Bench

        return Fp8Bench(problem, device)
    return gpu.CupyBench(problem, device)


def gpu_tuner(
    compile_fn: CompileFn | None = None,
    settings: MeasureSettings | None = None,
    *,
    free_pool: bool = False,
) -> Tuner:
    """A tuner that times on the current GPU through CuPy (:func:`bench_for`: the forward, the
    backward or the fp8 bench). ``free_pool``: afterwards, give the blocks its input
    sets leave in CuPy's memory pool back to the device (for callers of another library, torch,
    which cannot use them)."""

    def tuner(problem: ProblemDesc, key: TuningKey) -> TuningRecord:
        from kernelgen.tuning.gpu import free_memory_pool

        bench = bench_for(problem, key.device)
        try:
            return tune_problem(problem, key, bench, compile_fn=compile_fn, settings=settings)
        finally:
            if free_pool:
                del bench  # its input sets, now free blocks of the pool
                free_memory_pool()

    return tuner


def _winner(record: TuningRecord) -> TunedLaunch | None:
    """The record's launch; None (a warning: re-tune) when its winner is not a valid spec of
    its key's family."""
    try:
        spec = spec_of_family(record.winner)
    except SpecError as exc:
        log.warning("tuning record %s has an invalid winner (%s); re-tuning", record.key.id, exc)
        return None
    if family_of(spec) != record.key.problem.family:
        log.warning(
            "tuning record %s has a %s winner for a %s problem; re-tuning",
            record.key.id,
            family_of(spec),
            record.key.problem.family,
        )
        return None
    return TunedLaunch(spec, record.winner_splits)


def _report(key: TuningKey, launch: TunedLaunch, record: TuningRecord, source: str) -> None:
    if os.environ.get("KERNELGEN_PRINT_AUTOTUNING", "0") not in ("", "0"):
        ms = record.winner_ms
        timing = f"{ms:.4f} ms" if ms is not None else "? ms"
        print(
            f"kernelgen autotuning [{source}] {key.id}: {launch.label} ({timing})",
            file=sys.stderr,
        )


def select_spec(problem: ProblemDesc, device: DeviceInfo | None = None, **options: Any) -> AnySpec:
    """The spec of :func:`select_launch`'s choice (same options)."""
    return select_launch(problem, device, **options).spec


def select_launch(
    problem: ProblemDesc,
    device: DeviceInfo | None = None,
    *,
    software: SoftwareInfo | None = None,
    mode: str | None = None,
    db: TuningDB | None = None,
    tuner: Tuner | None = None,
    force: bool = False,
) -> TunedLaunch:
    """The spec and split count to run ``problem`` with (a backward problem: the backward spec):
    memo, then disk, then tune (under a lock) and record.

    ``device``/``software`` default to the current GPU and toolchain (via CuPy); ``mode``
    overrides ``KERNELGEN_AUTOTUNE``; ``force`` re-tunes even when a record exists."""
    mode = autotune_mode(mode)
    if device is None:
        from kernelgen.tuning.gpu import detect_device

        device = detect_device()
    if mode == "off":
        return TunedLaunch(heuristic_spec(problem, device))
    key = make_key(problem, device, software)
    if not force and (launch := _MEMO.get(key)) is not None:
        return launch
    db = db if db is not None else TuningDB()
    record = None if force else db.load(key)
    launch = _winner(record) if record is not None else None
    source = "disk"
    if launch is None:
        if mode == "offline":
            raise TuningMissError(
                f"no tuning record for {key.id} in {db.dir} (KERNELGEN_AUTOTUNE=offline); "
                "tune it with `kernelgen tune` or import one with `kernelgen cache import`"
            )
        with db.lock(key):
            record = None if force else db.load(key)  # another process may have tuned it
            launch = _winner(record) if record is not None else None
            if launch is None:
                start = time.perf_counter()
                record = (tuner or gpu_tuner())(problem, key)
                launch = TunedLaunch(spec_of_family(record.winner), record.winner_splits)
                elapsed = time.perf_counter() - start
                log.info("tuned %s in %.1f s: %s", key.id, elapsed, launch.label)
                db.save(record)
                source = "tuned"
    assert record is not None
    _report(key, launch, record, source)
    with _MEMO_LOCK:
        _MEMO[key] = launch
        _MEMO_GENERATION[0] += 1
    return launch


def autotune(
    problems: Iterable[ProblemDesc],
    device: DeviceInfo | None = None,
    *,
    force: bool = False,
    software: SoftwareInfo | None = None,
    db: TuningDB | None = None,
    tuner: Tuner | None = None,
) -> list[AnySpec]:
    """Tune (or read) each problem now, whatever ``KERNELGEN_AUTOTUNE`` says, so that later
    attention() (and, for backward problems, attention_backward()) calls only look up the memo.
    Options as for :func:`select_launch`."""
    options = {"software": software, "db": db, "tuner": tuner, "force": force}
    return [select_spec(p, device, mode="on", **options) for p in problems]


def warmup(
    shapes: Iterable[str | tuple[int, ...]],
    dtype: str,
    *,
    causal: bool = False,
    mask: bool = False,
    backward: bool = False,
    deterministic: bool = False,
    device: DeviceInfo | None = None,
    force: bool = False,
    software: SoftwareInfo | None = None,
    db: TuningDB | None = None,
    tuner: Tuner | None = None,
) -> list[AnySpec]:
    """:func:`autotune` for shapes given as ``(B, H, HKV, SQ, SK, D)`` or ``"B,H,HKV,SQ,SK,D"``
    (one ``dtype``: a shape alone does not say which kernel it needs); ``backward``: the
    backward problems of those shapes (``deterministic``: dQ without atomics)."""
    family = "backward" if backward else "forward"
    problems = [
        ProblemDesc.from_shape(s, dtype, causal, mask, family=family, deterministic=deterministic)
        for s in shapes
    ]
    return autotune(problems, device, force=force, software=software, db=db, tuner=tuner)


def clear_memo() -> None:
    """Forget the in-process memo (tests; after importing records)."""
    with _MEMO_LOCK:
        _MEMO.clear()
        _MEMO_GENERATION[0] += 1
