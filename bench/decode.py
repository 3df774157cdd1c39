"""``python -m bench.decode``: decode attention, achieved bandwidth against the copy.

For every shape of :mod:`bench.decode_shapes` it makes input sets (rotated past 2x L2), an fp32
reference chunked over (batch, kv head), then checks and times kernelgen's decode kernel (the
default decode spec, heuristic split count), kernelgen's autotuned launch, kernelgen without
split-KV and torch SDPA's backends; on request (``--peers``) kernelgen's fp8 decode on the bf16
sets rounded to e4m3 (rows of e4m3 shapes, checked against float64 of the rounded inputs).
Figures: median ms, achieved GB/s of the bytes model (:data:`bench.metrics.DECODE_BYTES_MODEL`)
and its fraction of the measured copy bandwidth.
Writes ``<out>/<date>-<gpu>-decode.{json,md}``. ``--help`` and ``--list`` need no GPU; torch,
CuPy and kernelgen are imported only by a run. Also reachable as ``python -m bench.attention
--decode``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime as dt
import math
import os
import sys
import time
import zlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from bench import decode_report as dr
from bench import harness, metrics, report
from bench.decode_shapes import HEAD_DIM, DecodeShape, grid
from bench.harness import GIB, ROOT, Harness, git_info, load_previous, positive_int

DEFAULT_MAX_KV_GIB = 24.0
MAX_SETS = 1024  # decode input sets are small: up to this many to exceed 2x L2
ONE_SET_L2 = 64  # a set this many times the L2 is timed alone (saves memory at 16 GiB sets)
REFERENCE = (
    "fp32 softmax(scale * q k^T) v by torch.bmm (TF32 off) on upcast inputs, chunked over "
    "(batch, kv head); relative Frobenius error"
)
SCRATCH = (
    "split-KV kernels allocate fp32 partials per call: num_splits * B * H * Sq * (D + 1) floats "
    "(kernelgen.runtime.launch.scratch_floats); kernelgen rows' extra_mem_limit_bytes is that "
    "scratch plus the fp32 LSE; extra_mem_ok is recorded, never a failure"
)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m bench.decode",
        description="Decode attention benchmark: achieved bandwidth of kernelgen's "
        "split-KV decode kernel as a fraction of the measured copy bandwidth, next to kernelgen "
        "without split-KV and torch SDPA (flash, cuDNN, efficient).",
    )
    p.add_argument("--quick", action="store_true", help="bf16, B 1/8, Hkv 8, Sk 4k/32k (4 shapes)")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results", help="results folder")
    p.add_argument("--dtype", action="append", metavar="bf16|fp16", help="repeatable")
    p.add_argument("--batch", action="append", type=int, metavar="B", help="repeatable")
    p.add_argument("--kv-heads", action="append", type=int, metavar="HKV", help="repeatable")
    p.add_argument("--seqlen-k", action="append", type=int, metavar="SK", help="repeatable")
    p.add_argument(
        "--seqlen-q", action="append", type=int, metavar="SQ", help="repeatable, 1 to 16 (1)"
    )
    p.add_argument(
        "--peers",
        default=",".join(dr.DEFAULT_PEER_NAMES),
        help=f"comma-separated subset of {','.join(dr.DECODE_PEER_NAMES)} (default: all but "
        f"{', '.join(dr.FP8_DECODE_PEERS)})",
    )
    p.add_argument(
        "--max-kv-gib",
        type=float,
        default=DEFAULT_MAX_KV_GIB,
        help="skip shapes whose K+V (one input set) exceed this many GiB (default 24)",
    )
    p.add_argument(
        "--sweep-splits",
        action="store_true",
        help="also time the kg-decode spec at num_splits "
        f"{', '.join(map(str, dr.SPLIT_SWEEP))} on the B=1 shapes",
    )
    p.add_argument("--budget-ms", type=float, help="time budget per measurement (200 quick, 500)")
    p.add_argument("--min-reps", type=int, default=20, help="timed repetitions, at least")
    p.add_argument(
        "--rounds",
        type=positive_int,
        default=3,
        help="timing rounds (default 3): a shape's peers are timed interleaved, each round in a "
        "rotated order on 1/rounds of the budget; rows report the spread between rounds",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tag", help="suffix of the result file names (after -decode)")
    p.add_argument(
        "--merge",
        action="store_true",
        help="merge rows into an existing result file of the same name (run the grid in slices)",
    )
    p.add_argument(
        "--fp8",
        action="store_true",
        help=f"also the opt-in fp8 cache peers ({', '.join(dr.FP8_DECODE_PEERS)}) beside --peers",
    )
    p.add_argument("--list", action="store_true", help="print the shapes and peers, then exit")
    args = p.parse_args(argv)
    if args.fp8:  # one peer list from here on
        args.peers = ",".join((args.peers, *dr.FP8_DECODE_PEERS))
    return args


def selected_peers(text: str) -> list[str]:
    """The decode peers named in ``text``, in the benchmark's order; ValueError for others."""
    names = {n.strip() for n in text.split(",") if n.strip()}
    unknown = sorted(names - set(dr.DECODE_PEER_NAMES))
    if unknown:
        known = ", ".join(dr.DECODE_PEER_NAMES)
        raise ValueError(f"unknown decode peer(s) {', '.join(unknown)}; known: {known}")
    return [n for n in dr.DECODE_PEER_NAMES if n in names]


def kv_budget_reason(shape: DecodeShape, max_kv_gib: float) -> str | None:
    """Why ``shape`` is skipped (its K+V exceed the budget), or None."""
    kv = metrics.decode_kv_bytes(shape)
    if kv > max_kv_gib * GIB:
        return f"K+V {kv / GIB:.3g} GiB > --max-kv-gib {max_kv_gib:g}"
    return None


def input_sets(l2_bytes: int | None, shape: DecodeShape) -> int:
    """Input sets to rotate through: together over 2x L2, at least two, except one for a set
    over ONE_SET_L2 x L2 (what a call could find left in L2 is then under 2% of its bytes)."""
    set_bytes = metrics.decode_set_bytes(shape)
    l2 = l2_bytes or metrics.DEFAULT_L2_BYTES
    minimum = 1 if set_bytes > ONE_SET_L2 * l2 else 2
    return metrics.rotation_count(l2, set_bytes, minimum=minimum, maximum=MAX_SETS)


def list_plan(shapes: list[DecodeShape], args: argparse.Namespace) -> None:
    print(
        f"{len(shapes)} decode shapes (D={HEAD_DIM}; sets to rotate at a 50 MiB L2; "
        f"K+V budget {args.max_kv_gib:g} GiB):"
    )
    for s in shapes:
        skip = kv_budget_reason(s, args.max_kv_gib)
        print(
            f"  {s.key:28} B={s.batch:<3} H={s.heads}/{s.kv_heads:<2} Sq={s.seqlen_q:<2} "
            f"Sk={s.seqlen_k:<6} K+V {metrics.decode_kv_bytes(s) / 2**20:9.1f} MiB  "
            f"moved {metrics.decode_bytes_moved(s) / 2**20:9.1f} MiB  "
            f"{input_sets(None, s):4} sets" + (f"  SKIP: {skip}" if skip else "")
        )
    print(f"peers: {', '.join(selected_peers(args.peers))}")
    if args.sweep_splits:
        print(f"split sweep at B=1: num_splits {', '.join(map(str, dr.SPLIT_SWEEP))}")


# ---- the GPU layer (torch, CuPy and kernelgen are imported lazily by bench.gpu) ----------------
def make_sets(env: Any, shape: DecodeShape, count: int, seed: int) -> list[tuple[Any, Any, Any]]:
    """``count`` independent (q, k, v) sets, normal in the dtype itself (no fp32 temporary):
    q (B, H, Sq, D), k and v (B, Hkv, Sk, D)."""
    torch = env.torch
    dtype = getattr(torch, shape.dtype)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q_shape = (shape.batch, shape.heads, shape.seqlen_q, shape.head_dim)
    kv_shape = (shape.batch, shape.kv_heads, shape.seqlen_k, shape.head_dim)

    def randn(size: tuple[int, ...]) -> Any:
        return torch.empty(size, device="cuda", dtype=dtype).normal_(generator=gen)

    return [(randn(q_shape), randn(kv_shape), randn(kv_shape)) for _ in range(count)]


def reference(
    env: Any, q: Any, k: Any, v: Any, chunk_bytes: int = 1 << 30, dtype: str = "float32"
) -> Any:
    """fp32 (or ``dtype``: float64 for the fp8 rows) attention of q (B, H, Sq, D) over k, v
    (B, Hkv, Sk, D), query head h reading kv head h // (H / Hkv), in groups of (batch, kv head)
    pairs whose upcast K, V and scores fit ``chunk_bytes``."""
    from bench.gpu import exact_fp32

    torch = env.torch
    cast = getattr(torch, dtype)
    batch, heads, seqlen_q, head_dim = q.shape
    kv_heads, seqlen_k = k.shape[1], k.shape[2]
    rows = heads // kv_heads * seqlen_q
    qf = q.reshape(batch * kv_heads, rows, head_dim)
    kf, vf = (t.reshape(batch * kv_heads, seqlen_k, head_dim) for t in (k, v))
    out = torch.empty((batch * kv_heads, rows, head_dim), device=q.device, dtype=cast)
    pair_bytes = cast.itemsize * seqlen_k * (2 * head_dim + rows)
    step = max(1, chunk_bytes // pair_bytes)
    scale = 1.0 / math.sqrt(head_dim)
    with exact_fp32(torch):
        for start in range(0, batch * kv_heads, step):
            part = slice(start, start + step)
            scores = torch.bmm(qf[part].to(cast), kf[part].to(cast).transpose(1, 2)) * scale
            out[part] = torch.bmm(torch.softmax(scores, dim=-1), vf[part].to(cast))
    return out.view(batch, heads, seqlen_q, head_dim)


def decode_impl(env: Any, peer: str, spec: Any, num_splits: int | None) -> Any:
    """``kernelgen.attention(q, k, v, spec=spec, num_splits=num_splits)`` on torch's stream
    (``spec`` None: the autotuner's choice), outputs NaN-poisoned for the check."""
    from bench.gpu import Impl, poisoned_kernelgen_outputs

    kg = env.kernelgen

    def call(q: Any, k: Any, v: Any) -> Any:
        with env.stream():
            return kg.attention(q, k, v, spec=spec, num_splits=num_splits)

    uri = spec.uri if spec is not None else None
    return Impl(peer, call, spec_uri=uri, poison=lambda: poisoned_kernelgen_outputs(env))


def paged_sets(env: Any, sets: list, page_size: int, seed: int) -> dict[int, tuple]:
    """For each (q, k, v) set, by ``id(k)``: K and V copied into pools of pages
    (pages, page_size, Hkv, D) in shuffled order, the int32 block table (B, pages per
    sequence) and the device lengths (all Sk): what ``attention_with_kvcache`` reads."""
    torch = env.torch
    generator = torch.Generator(device="cpu").manual_seed(seed)
    paged = {}
    for _, k, v in sets:
        batch, kv_heads, seqlen_k, head_dim = k.shape
        per_seq = -(-seqlen_k // page_size)
        order = torch.randperm(batch * per_seq, generator=generator).to(k.device)
        pools = []
        for t in (k, v):
            padded = torch.zeros(
                (batch, per_seq * page_size, kv_heads, head_dim), device=t.device, dtype=t.dtype
            )
            padded[:, :seqlen_k] = t.transpose(1, 2)
            pool = torch.empty_like(padded).view(batch * per_seq, page_size, kv_heads, head_dim)
            pool[order] = padded.view(batch * per_seq, page_size, kv_heads, head_dim)
            pools.append(pool)
        table = order.view(batch, per_seq).to(torch.int32)
        lengths = torch.full((batch,), seqlen_k, dtype=torch.int32, device=k.device)
        paged[id(k)] = (*pools, table, lengths)
    return paged


def paged_impl(env: Any, peer: str, spec: Any, paged: dict[int, tuple]) -> Any:
    """``kernelgen.attention_with_kvcache`` over the paged copy of a set's K and V (q in
    "bshd" as a view; out returned as a (B, H, Sq, D) view for the check)."""
    from bench.gpu import Impl, poisoned_kernelgen_outputs

    kg = env.kernelgen

    def call(q: Any, k: Any, v: Any) -> Any:
        k_pool, v_pool, table, lengths = paged[id(k)]
        with env.stream():
            out = kg.attention_with_kvcache(
                q.transpose(1, 2), k_pool, v_pool, lengths, block_table=table, spec=spec
            )
        return out.transpose(1, 2)

    return Impl(peer, call, spec_uri=spec.uri, poison=lambda: poisoned_kernelgen_outputs(env))


def fp8_caches(env: Any, sets: list, page_size: int, seed: int) -> dict[int, tuple]:
    """For each bf16 (q, k, v) set, by ``id(q)``: q rounded to e4m3 as a (B, Sq, H, D) view, the
    e4m3 caches (contiguous (B, Sk, Hkv, D) views, or with ``page_size`` pools of pages in
    shuffled order, :func:`paged_sets`, copied as bytes), the int32 lengths (all Sk), the block
    table (None: contiguous) and the rounded (q, k, v) in (B, H, S, D) for the reference."""
    torch = env.torch
    fp8, uint8 = torch.float8_e4m3fn, torch.uint8
    rounded = [tuple(t.to(fp8) for t in s) for s in sets]
    as_bytes = [(q8, k8.view(uint8), v8.view(uint8)) for q8, k8, v8 in rounded]
    pools = paged_sets(env, as_bytes, page_size, seed) if page_size else {}
    caches = {}
    for (q, k, _), (q8, k8, v8), (_, k_bytes, _) in zip(sets, rounded, as_bytes, strict=True):
        if page_size:
            k_pool, v_pool, table, lengths = pools[id(k_bytes)]
            k_cache, v_cache = k_pool.view(fp8), v_pool.view(fp8)
        else:
            k_cache, v_cache, table = k8.transpose(1, 2), v8.transpose(1, 2), None
            lengths = torch.full((k.shape[0],), k.shape[2], dtype=torch.int32, device=k.device)
        caches[id(q)] = (q8.transpose(1, 2), k_cache, v_cache, lengths, table, (q8, k8, v8))
    return caches


def fp8_cache_impl(env: Any, peer: str, spec: Any, caches: dict[int, tuple]) -> Any:
    """``kernelgen.attention_with_kvcache`` on the e4m3 cache of the set it is called with
    (:func:`fp8_caches`; out as a (B, H, Sq, D) bf16 view), checked within the fp8 tolerance."""
    from bench.gpu import Impl, poisoned_kernelgen_outputs

    kg = env.kernelgen

    def call(q: Any, k: Any, v: Any) -> Any:
        q8, k_cache, v_cache, lengths, table, _ = caches[id(q)]
        with env.stream():
            out = kg.attention_with_kvcache(
                q8, k_cache, v_cache, lengths, block_table=table, spec=spec
            )
        return out.transpose(1, 2)

    return Impl(
        peer,
        call,
        spec_uri=spec.uri,
        poison=lambda: poisoned_kernelgen_outputs(env),
        tolerance=metrics.tolerance(dr.FP8_DTYPE),
    )


def problem_desc(shape: DecodeShape) -> Any:
    """The autotuner's description of ``shape`` (``kernelgen.tuning.ProblemDesc``)."""
    from kernelgen.tuning import ProblemDesc

    return ProblemDesc(
        shape.dtype,
        shape.batch,
        shape.heads,
        shape.kv_heads,
        shape.seqlen_q,
        shape.seqlen_k,
        shape.head_dim,
    )


class TorchRefusedError(Exception):
    """A torch variant that cannot run a shape: (unavailable?, reason)."""

    def __init__(self, unavailable: bool, reason: str) -> None:
        super().__init__(reason)
        self.unavailable = unavailable
        self.reason = reason


Build = Callable[[DecodeShape, list], tuple[Any, dict[str, Any]]]


class DecodeRunner(Harness):
    """The harness's check, memory and timing (``measure``, ``guarded``, ``compiled``) with
    decode's inputs, reference, peers and figures."""

    def __init__(self, env: Any, args: argparse.Namespace, floors: dict[str, Any]) -> None:
        super().__init__(env, args, floors, selected_peers(args.peers))
        self.interleave = True  # a shape's peers are timed together (shape_rows)

    def figures(self, shape: Any, times: list[float]) -> dict[str, Any]:
        stats = metrics.summarize(times)
        copy = self.floors.get("copy_gbps")
        return {**stats, **metrics.decode_figures(shape, stats["median_ms"], copy)}

    # -- one shape --
    def shape_rows(self, shape: Any) -> list[dict[str, Any]]:
        """Every selected peer (and with ``--sweep-splits`` at B=1 the split counts)."""
        env = self.env
        n_sets = input_sets(env.info.get("l2_bytes"), shape)
        seed = self.args.seed * 1000 + zlib.crc32(shape.key.encode()) % 1000
        sets = make_sets(env, shape, n_sets, seed)
        ref = reference(env, *sets[0])
        peers = list(self.peers)
        if self.args.sweep_splits and shape.batch == 1:
            peers += [dr.split_peer(n) for n in dr.SPLIT_SWEEP]
        rows = [self.safe_row(shape, peer, sets, ref) for peer in peers]
        self.time_pending(rows)  # every checked peer, interleaved in rounds
        for row in rows:
            row["n_sets"] = n_sets
            print(dr.progress_line(row), flush=True)
        del sets, ref
        self.gpu.release(env)
        return dr.add_comparisons(rows)

    def safe_row(self, shape: DecodeShape, peer: str, sets: list, ref: Any) -> dict[str, Any]:
        """``peer_row``, or an error row for anything it raises short of a dead context."""
        gpu = self.gpu
        try:
            row = self.peer_row(shape, peer, sets, ref)
        except gpu.FatalGPUError:
            raise
        except Exception as exc:
            self.env.sync()
            row = report.make_row(shape, peer, report.ERROR, reason=gpu.first_line(exc))
        peer_info = dr.DECODE_PEERS_BY_NAME.get(peer)
        row.setdefault("label", peer_info.label if peer_info else f"kernelgen decode spec, {peer}")
        return row

    def peer_row(self, shape: DecodeShape, peer: str, sets: list, ref: Any) -> dict[str, Any]:
        if peer.startswith("torch-"):
            backends = {v: k for k, v in self.gpu.BACKEND_PEERS.items()}
            return self.torch_row(shape, backends[peer.split("-", 1)[1]], sets, ref)
        if self.env.kernelgen is None:
            reason = self.env.kernelgen_error
            return report.make_row(shape, peer, report.UNAVAILABLE, reason=reason)
        if peer in dr.FP8_DECODE_PEERS:
            return self.fp8_row(shape, peer, sets)
        if peer in dr.WGMMA_DECODE_PEERS:
            if self.env.arch != "sm_90":
                arch = self.env.arch
                reason = f"wgmma (sm_90a) runs on compute capability 9.0 only; this GPU is {arch}"
                return report.make_row(shape, peer, report.UNAVAILABLE, reason=reason)
            build: Build = self.wgmma_builder(peer, dr.wgmma_page_size_of(peer))
        elif peer == dr.TUNED_PEER:
            build = self.build_tuned
        elif peer == dr.NOSPLIT_PEER:
            build = self.builder(peer, decode=False)
        elif (page_size := dr.page_size_of(peer)) is not None:
            build = self.paged_builder(peer, page_size)
        else:  # kg-decode, or kg-split-<n> of the sweep
            build = self.builder(peer, decode=True, num_splits=dr.split_count(peer))
        return self.kernelgen_row(shape, peer, build, sets, ref)

    # -- kernelgen --
    def kernelgen_row(
        self, shape: DecodeShape, peer: str, build: Build, sets: list, ref: Any
    ) -> dict[str, Any]:
        """Build (spec, compile, launch facts), check, then time one kernelgen peer."""
        info: dict[str, Any] = {}

        def make() -> Any:
            impl, facts = build(shape, sets)
            info.update(facts)
            return impl

        row = self.guarded(shape, peer, make, sets, ref)
        limit = info.pop("mem_limit_bytes", None)
        row.update(info)
        memory_rule(row, limit)
        return row

    def kg_spec(self, shape: DecodeShape, decode: bool) -> Any:
        """kernelgen's default decode spec (``decode_rows``) or its tensor-core prefill spec."""
        kg = self.env.kernelgen
        args = (shape.dtype, shape.head_dim, False, self.env.arch)
        if decode:
            return kg.default_spec(*args, decode_rows=shape.seqlen_q * shape.group)
        return kg.default_spec(*args)

    def builder(self, peer: str, decode: bool, num_splits: int | None = None) -> Build:
        """A Build for a default spec at ``num_splits`` (None: kernelgen's heuristic)."""

        def build(shape: DecodeShape, _sets: list) -> tuple[Any, dict[str, Any]]:
            spec = self.kg_spec(shape, decode)
            self.compiled(spec)
            splits = num_splits or self.heuristic_splits(spec, shape)
            facts = {**self.launch_facts(spec, shape, splits)}
            facts["compile_s"] = round(self.compile_s[spec.uri], 3)
            return decode_impl(self.env, peer, spec, num_splits), facts

        return build

    def paged_builder(self, peer: str, page_size: int) -> Build:
        """A Build for kg-decode's spec with ``paged_kv`` over paged copies of the sets."""

        def build(shape: DecodeShape, sets: list) -> tuple[Any, dict[str, Any]]:
            spec = self.kg_spec(shape, decode=True).model_copy(update={"paged_kv": True})
            spec = type(spec).model_validate(spec.model_dump())  # a validated spec
            self.compiled(spec)
            splits = self.heuristic_splits(spec, shape)
            facts = {**self.launch_facts(spec, shape, splits), "page_size": page_size}
            facts["compile_s"] = round(self.compile_s[spec.uri], 3)
            pages = paged_sets(self.env, sets, page_size, seed=self.args.seed)
            return paged_impl(self.env, peer, spec, pages), facts

        return build

    def wgmma_builder(self, peer: str, page_size: int) -> Build:
        """A Build for the Hopper decode spec (``policy.hopper_decode_spec``) at the heuristic
        split count; ``page_size`` > 0: over paged copies of the sets."""

        def build(shape: DecodeShape, sets: list) -> tuple[Any, dict[str, Any]]:
            from kernelgen.model.policy import hopper_decode_spec

            rows = shape.seqlen_q * shape.group
            spec = hopper_decode_spec(
                shape.dtype, shape.head_dim, False, rows, shape.group, paged_kv=page_size > 0
            )
            if spec is None:
                raise ValueError(
                    f"no wgmma decode spec for dtype {shape.dtype}, D {shape.head_dim}"
                )
            if peer == dr.WGMMA_TMA_PEER:
                spec = type(spec).model_validate({**spec.model_dump(), "epilogue": "tma"})
            self.compiled(spec)
            splits = self.heuristic_splits(spec, shape)
            facts = {**self.launch_facts(spec, shape, splits)}
            facts["compile_s"] = round(self.compile_s[spec.uri], 3)
            if not page_size:
                return decode_impl(self.env, peer, spec, None), facts
            facts["page_size"] = page_size
            pages = paged_sets(self.env, sets, page_size, seed=self.args.seed)
            return paged_impl(self.env, peer, spec, pages), facts

        return build

    def fp8_row(self, shape: DecodeShape, peer: str, sets: list) -> dict[str, Any]:
        """An fp8 peer on the e4m3 twin of a bf16 shape (its row, bytes model and tolerance):
        policy.fp8_decode_spec at the heuristic split count on the rounded sets' caches,
        checked against float64 attention of the rounded inputs."""
        from kernelgen.model.policy import fp8_decode_spec
        from kernelgen.specs.forward import FP8_HEAD_DIMS

        fp8_shape = dataclasses.replace(shape, dtype=dr.FP8_DTYPE)
        reason = None
        if self.env.arch != "sm_90":
            arch = self.env.arch
            reason = f"fp8 wgmma (sm_90a) runs on compute capability 9.0 only; this GPU is {arch}"
        elif shape.dtype != "bfloat16" or shape.head_dim not in FP8_HEAD_DIMS:
            reason = f"fp8 rows round bf16 shapes at head dim {FP8_HEAD_DIMS}"
        if reason is not None:
            return report.make_row(fp8_shape, peer, report.UNAVAILABLE, reason=reason)
        page_size = dr.fp8_page_size_of(peer)
        caches = fp8_caches(self.env, sets, page_size, seed=self.args.seed)
        ref = reference(self.env, *caches[id(sets[0][0])][-1], dtype="float64")

        def build(_shape: DecodeShape, _sets: list) -> tuple[Any, dict[str, Any]]:
            spec = fp8_decode_spec(shape.head_dim, False, shape.group, paged_kv=page_size > 0)
            self.compiled(spec)
            splits = self.heuristic_splits(spec, fp8_shape)
            facts = {**self.launch_facts(spec, fp8_shape, splits), "page_size": page_size}
            facts["compile_s"] = round(self.compile_s[spec.uri], 3)
            return fp8_cache_impl(self.env, peer, spec, caches), facts

        return self.kernelgen_row(fp8_shape, peer, build, sets, ref)

    def build_tuned(self, shape: DecodeShape, sets: list) -> tuple[Any, dict[str, Any]]:
        """attention(spec=None): the first call tunes (or reads the database); it is timed
        apart as ``autotune_s`` and left out of the measurement."""
        impl = decode_impl(self.env, dr.TUNED_PEER, None, None)
        start = time.perf_counter()
        impl.call(*sets[0])
        self.env.sync()
        facts: dict[str, Any] = {
            "autotune_s": round(time.perf_counter() - start, 3),
            "autotune_mode": os.environ.get("KERNELGEN_AUTOTUNE", "1"),
        }
        try:
            from kernelgen.tuning import select_launch

            launch = select_launch(problem_desc(shape))  # memoized by the call above
        except Exception as exc:  # the choice is reporting only; the call itself ran
            facts["tuned_choice_error"] = self.gpu.first_line(exc)
            return impl, facts
        impl.spec_uri = launch.spec.uri
        splits = launch.num_splits or self.heuristic_splits(launch.spec, shape)
        return impl, {**facts, **self.launch_facts(launch.spec, shape, splits)}

    def heuristic_splits(self, spec: Any, shape: DecodeShape) -> int:
        """The split count a call without ``num_splits`` launches: the runtime kernel's own
        heuristic (this device's SMs and limits, the compiled kernel's registers)."""
        from kernelgen.runtime.launch import runtime_kernel
        from kernelgen.tuning.candidates import launch_problem

        return runtime_kernel(spec).default_num_splits(launch_problem(problem_desc(shape)))

    def launch_facts(self, spec: Any, shape: DecodeShape, splits: int) -> dict[str, Any]:
        """Split count, spec flags, fp32 scratch bytes and the extra-memory bound of a launch."""
        from kernelgen.runtime.launch import scratch_floats
        from kernelgen.tuning.candidates import launch_problem

        problem = launch_problem(problem_desc(shape), splits if spec.split_kv else 1)
        scratch = 4 * sum(scratch_floats(spec, problem).values())
        lse = 4 * shape.batch * shape.heads * shape.seqlen_q
        return {
            "num_splits": splits if spec.split_kv else 1,
            "pack_gqa": spec.pack_gqa,
            "split_kv": spec.split_kv,
            "scratch_bytes": scratch,
            "mem_limit_bytes": lse + scratch,
        }

    # -- torch --
    def torch_row(self, shape: Any, backend: str, sets: list, ref: Any) -> dict[str, Any]:
        """torch SDPA forced to one backend. GQA shapes: ``enable_gqa=True`` first, else K/V
        expanded to H heads (repeat_interleave outside the timed region, within the budget)."""
        gpu = self.gpu
        peer = f"torch-{gpu.BACKEND_PEERS[backend]}"
        failures: list[TorchRefusedError] = []
        for suffix, make_impl, make_sets in self.torch_variants(shape, backend, sets):
            try:
                impl, use = self.probe(make_impl, make_sets)
            except TorchRefusedError as refused:
                reason = f"{suffix}: {refused}" if suffix else str(refused)
                failures.append(TorchRefusedError(refused.unavailable, reason))
                continue
            row = self.guarded(shape, peer, lambda impl=impl: impl, use, ref)
            row["label"] = dr.DECODE_PEERS_BY_NAME[peer].label + (f" ({suffix})" if suffix else "")
            memory_rule(row, None)
            return row
        unavailable = all(f.unavailable for f in failures)
        status = report.UNAVAILABLE if unavailable else report.ERROR
        return report.make_row(shape, peer, status, reason="; ".join(f.reason for f in failures))

    def torch_variants(
        self, shape: DecodeShape, backend: str, sets: list
    ) -> list[tuple[str, Callable[[], Any], Callable[[], list]]]:
        """(label suffix, impl factory, input sets factory) to try in order."""
        env, gpu = self.env, self.gpu

        def plain() -> Any:
            return gpu.torch_sdpa(env, backend, False)

        def grouped() -> Any:
            return gpu.torch_sdpa(env, backend, False, gqa=True)

        if shape.group == 1:
            return [("", plain, lambda: sets)]
        return [
            ("enable_gqa=True", grouped, lambda: sets),
            ("K/V expanded", plain, lambda: self.expanded(shape, sets)),
        ]

    def expanded(self, shape: DecodeShape, sets: list) -> list:
        """The sets with K and V repeated to H heads; TorchRefusedError above the budget."""
        need = len(sets) * shape.group * metrics.decode_kv_bytes(shape)
        if need > self.args.max_kv_gib * GIB:
            raise TorchRefusedError(
                True, f"{need / GIB:.3g} GiB > --max-kv-gib {self.args.max_kv_gib:g}"
            )
        g = shape.group
        return [
            (q, k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)) for q, k, v in sets
        ]

    def probe(self, make_impl: Callable[[], Any], make_sets: Callable[[], list]) -> tuple:
        """(impl, sets) after one successful call, else TorchRefusedError (torch's reason)."""
        gpu = self.gpu
        with gpu.capture_warnings() as caught:
            try:
                use = make_sets()
                impl = make_impl()
                impl.call(*use[0])
                self.env.sync()
            except (gpu.FatalGPUError, TorchRefusedError):
                raise
            except Exception as exc:
                self.env.sync()
                raise TorchRefusedError(*gpu.classify_torch_failure(exc, caught)) from exc
        return impl, use


def memory_rule(row: dict[str, Any], limit: int | None) -> None:
    """Decode's extra-memory bound (None: none) in place of the prefill LSE rule; recorded,
    never a failure."""
    if "extra_mem_bytes" in row:
        row["extra_mem_limit_bytes"] = limit
        row["extra_mem_ok"] = None if limit is None else row["extra_mem_bytes"] <= limit


# ---- the run ------------------------------------------------------------------------------------
def run_meta(env: Any, today: dt.date) -> dict[str, Any]:
    """Provenance of a run: device, versions, commit, methods."""
    from bench import gpu

    kg = env.kernelgen
    template_hash = None
    if kg is not None:
        with contextlib.suppress(Exception):
            template_hash = env.kg_module("kernels.render").template_hash()
    return {
        "date": today.isoformat(),
        "benchmark": "decode",
        **env.info,
        "kernelgen_version": getattr(kg, "__version__", None),
        "kernelgen_error": env.kernelgen_error,
        "template_hash": template_hash,
        **git_info(),
        "clocks_start": harness.gpu_clocks(),
        "python": sys.version.split()[0],
        "autotune_mode": os.environ.get("KERNELGEN_AUTOTUNE", "1"),
        "timing": gpu.TIMING_METHOD,
        "memory_method": gpu.MEMORY_METHOD,
        "reference": REFERENCE,
        "bytes_model": metrics.DECODE_BYTES_MODEL,
        "scratch": SCRATCH,
    }


def write_results(
    paths: dict[str, Path],
    meta: dict[str, Any],
    floors: dict[str, Any],
    rows: list[dict[str, Any]],
    settings: dict[str, Any],
) -> list[Path]:
    """Write the .json and .md (atomically); the paths written."""
    result = report.build_result(meta, floors, rows, settings, sort=dr.sort_rows)
    report.write_atomic(paths["json"], report.to_json(result))
    report.write_atomic(paths["md"], dr.markdown_document(result))
    return [paths["json"], paths["md"]]


def shape_or_error(runner: DecodeRunner, shape: DecodeShape) -> list[dict[str, Any]]:
    """The shape's rows: one ``all`` row when the budget skips it or its inputs fail (e.g.
    out of memory). FatalGPUError passes through."""
    skip = kv_budget_reason(shape, runner.args.max_kv_gib)
    if skip:
        row = report.make_row(shape, dr.ALL, report.SKIPPED, reason=skip)
        print(dr.progress_line(row), flush=True)
        return [row]
    return harness.shape_or_error(runner, shape)


def run(args: argparse.Namespace, shapes: list[DecodeShape]) -> int:
    from bench import gpu

    env = harness.open_env()
    if env is None:
        return 2
    today = dt.date.today()
    meta = run_meta(env, today)
    settings = harness.run_settings(
        args, shapes, max_sets=MAX_SETS, split_sweep=list(dr.SPLIT_SWEEP), timing_rounds=args.rounds
    )
    runner = DecodeRunner(env, args, floors={})
    print(f"bench.decode: {env.info['gpu_name']}, {len(shapes)} shapes, peers {args.peers}")
    runner.floors = floors = gpu.measure_floors(env, runner.timer)
    print(f"floor: copy {floors['copy_gbps']:.0f} GB/s (read + write)", flush=True)
    tag = f"decode-{args.tag}" if args.tag else "decode"
    paths = report.result_paths(args.out, report.result_stem(today, env.info["gpu_name"], tag))
    previous = load_previous(paths["json"]) if args.merge else []

    def checkpoint(rows: list[dict[str, Any]]) -> None:
        meta["compile_s"] = runner.compile_s
        write_results(
            paths, meta, floors, report.merge_rows(previous, rows, dr.sort_rows), settings
        )

    rows, fatal = harness.run_shapes(shapes, lambda s: shape_or_error(runner, s), checkpoint)
    meta["fatal"] = fatal
    meta["clocks_end"] = harness.gpu_clocks()
    all_rows = report.merge_rows(previous, rows, dr.sort_rows)
    for path in write_results(paths, meta, floors, all_rows, settings):
        print(f"wrote {path}")
    print()
    print(dr.markdown_table(all_rows))
    print()
    print("\n".join(dr.target_lines(dr.evaluate_targets(all_rows))))
    return 1 if fatal else 0


def selected_shapes(args: argparse.Namespace) -> list[DecodeShape]:
    """The grid the flags select; ValueError for a bad flag, a bad peer or no shape."""
    selected_peers(args.peers)
    shapes = grid(
        quick=args.quick,
        dtypes=args.dtype,
        batches=args.batch,
        kv_heads=args.kv_heads,
        seqlens_k=args.seqlen_k,
        seqlens_q=args.seqlen_q,
    )
    if not shapes:
        raise ValueError("no shapes selected")
    return shapes


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        shapes = selected_shapes(args)
    except ValueError as exc:
        print(f"bench: {exc}", file=sys.stderr)
        return 2
    if args.list:
        list_plan(shapes, args)
        return 0
    return run(args, shapes)


if __name__ == "__main__":
    sys.exit(main())
