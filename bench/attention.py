"""``python -m bench.attention``: attention forward TFLOP/s of kernelgen and its peers.

Runs the shape grid (bench.shapes), checks every implementation against an fp32 reference
before timing it, times with CUDA events (bench.gpu.Timer) and writes
``<out>/<date>-<gpu>.{json,md,png}``. ``--help`` and ``--list`` need no GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import sys
import zlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from bench import metrics, report
from bench.candidates import (
    FP8_PEER,
    PEER_NAMES,
    PEERS_BY_NAME,
    candidate_label,
    fp8_candidates,
    identity,
    spec_fields,
    tensor_core_candidates,
    v1_fields,
    wgmma_candidates,
)
from bench.harness import (
    GIB,
    ROOT,
    Harness,
    git_info,
    gpu_clocks,
    load_previous,
    open_env,
    positive_int,
    run_settings,
    run_shapes,
    shape_or_error,
)
from bench.shapes import Shape, grid

CANDIDATE_BUDGET_MS = 100.0  # screening; the best candidate is then re-timed on the full budget


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m bench.attention",
        description="Benchmark kernelgen's attention forward kernels against torch SDPA "
        "(flash, cuDNN, efficient), a naive CuPy version, and kernelgen's CUDA-core kernels.",
    )
    p.add_argument("--quick", action="store_true", help="small grid: bf16, d64/128, S 1k/4k")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results", help="results folder")
    p.add_argument(
        "--decode",
        action="store_true",
        help="run the decode benchmark instead (python -m bench.decode; the other flags are "
        "then its flags, see --decode --help)",
    )
    p.add_argument("--dtype", action="append", metavar="bf16|fp16", help="repeatable")
    p.add_argument("--head-dim", action="append", type=int, metavar="D", help="repeatable")
    p.add_argument("--seqlen", action="append", type=int, metavar="S", help="repeatable")
    p.add_argument(
        "--causal",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="only causal (--causal) or only non-causal (--no-causal); default both",
    )
    p.add_argument("--tokens", type=int, default=16384, help="batch * seqlen (default 16384)")
    p.add_argument(
        "--peers",
        default=",".join(PEER_NAMES),
        help=f"comma-separated subset of {','.join(PEER_NAMES)}",
    )
    p.add_argument("--budget-ms", type=float, help="time budget per measurement (200 quick, 500)")
    p.add_argument("--min-reps", type=int, default=20, help="timed repetitions, at least")
    p.add_argument(
        "--rounds",
        type=positive_int,
        default=3,
        help="timing rounds per measurement (default 3): a shape's peers, and a kernelgen row's "
        "candidates, are timed interleaved, each round in a rotated order on 1/rounds of the "
        "budget; rows report the spread between rounds",
    )
    p.add_argument(
        "--simt-max-seqlen",
        type=int,
        default=4096,
        help="time kernelgen's CUDA-core kernels only up to this seqlen (they are slow)",
    )
    p.add_argument(
        "--naive-max-gib", type=float, default=4.0, help="skip naive above this fp32 score size"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tag", help="suffix of the result file names")
    p.add_argument(
        "--merge",
        action="store_true",
        help="merge rows into an existing result file of the same name (run the grid in slices)",
    )
    p.add_argument(
        "--list", action="store_true", help="print the shapes and candidate specs, then exit"
    )
    return p.parse_args(argv)


def selected_peers(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in PEERS_BY_NAME]
    if unknown:
        raise ValueError(f"unknown peer(s) {', '.join(unknown)}; known: {', '.join(PEER_NAMES)}")
    return [n for n in PEER_NAMES if n in names]


# ---- one shape ----------------------------------------------------------------------------------
class Runner(Harness):
    """Runs every selected peer on one shape after another, producing result rows."""

    def __init__(self, env: Any, args: argparse.Namespace, floors: dict[str, Any]) -> None:
        super().__init__(env, args, floors, selected_peers(args.peers))
        self.interleave = True  # a shape's peers are timed together (shape_rows)
        self.candidates = tensor_core_candidates(quick=args.quick)
        self.quick = args.quick

    def figures(self, shape: Shape, times: list[float]) -> dict[str, Any]:
        """TFLOP/s and the gaps to the matmul and copy floors."""
        stats = metrics.summarize(times)
        flops = metrics.shape_flops(shape)
        rate = metrics.tflops(flops, stats["median_ms"])
        matmul = self.floors.get("matmul_tflops", {}).get(shape.dtype)
        copy_bps = (self.floors.get("copy_gbps") or 0) * 1e9 or None
        compute_ms, memory_ms = metrics.floor_ms(flops, metrics.min_bytes(shape), matmul, copy_bps)
        floor = max(x for x in (compute_ms, memory_ms, 0.0) if x is not None)
        return {
            **stats,
            "flops": flops,
            "tflops": rate,
            "frac_of_matmul": rate / matmul if rate and matmul else None,
            "compute_floor_ms": compute_ms,
            "memory_floor_ms": memory_ms,
            "gap": stats["median_ms"] / floor if floor else None,
        }

    # -- the peers --
    def torch_row(self, shape: Shape, backend: str, sets: list, ref: Any) -> dict[str, Any]:
        gpu = self.gpu
        peer = f"torch-{gpu.BACKEND_PEERS[backend]}"
        with gpu.capture_warnings() as caught:
            try:
                impl = gpu.torch_sdpa(self.env, backend, shape.causal)
                impl.call(*sets[0])
                self.env.sync()
            except gpu.FatalGPUError:
                raise
            except Exception as exc:
                self.env.sync()
                unavailable, reason = gpu.classify_torch_failure(exc, caught)
                status = report.UNAVAILABLE if unavailable else report.ERROR
                return report.make_row(shape, peer, status, reason=reason)
        return self.guarded(shape, peer, lambda: impl, sets, ref)

    def naive_row(self, shape: Shape, sets: list, ref: Any) -> dict[str, Any]:
        score = metrics.naive_score_bytes(shape)
        if score > self.args.naive_max_gib * GIB:
            reason = f"fp32 score matrix {score / GIB:.1f} GiB > {self.args.naive_max_gib:g} GiB"
            return report.make_row(shape, "cupy-naive", report.SKIPPED, reason=reason)
        return self.guarded(
            shape, "cupy-naive", lambda: self.gpu.naive_cupy(self.env, shape), sets, ref
        )

    def default_spec(self, shape: Shape, tensor_cores: bool) -> Any:
        """kernelgen.default_spec for the shape: CUDA-core or tensor-core (None if it has none)."""
        kg = self.env.kernelgen
        args = (shape.dtype, shape.head_dim, shape.causal, self.env.arch)
        try:
            spec = kg.default_spec(*args, tensor_cores=tensor_cores)
        except TypeError:  # a kernelgen whose default_spec has no tensor_cores switch
            spec = kg.default_spec(*args)
        is_tc = getattr(spec, "mma", "simt") == "mma_sync"
        return spec if is_tc == tensor_cores else None

    def base_fields(self, shape: Shape) -> dict[str, Any]:
        """Fields of the CUDA-core default spec (v2)."""
        spec = self.default_spec(shape, tensor_cores=False)
        if spec is None:
            raise ValueError("kernelgen.default_spec gave no CUDA-core spec for this shape")
        return spec.model_dump(mode="json")

    def candidate_list(self, shape: Shape, base: dict[str, Any]) -> list[tuple[str, dict]]:
        """(label, spec fields): kernelgen's tensor-core default first, then the grid."""
        out = []
        with contextlib.suppress(Exception):
            default = self.default_spec(shape, tensor_cores=True)
            if default is not None:
                out.append(("default", default.model_dump(mode="json")))
        for overrides in self.candidates:
            out.append((candidate_label(overrides), spec_fields(identity(base), overrides)))
        return out

    def spec_from(self, fields: dict[str, Any]) -> Any:
        from kernelgen.specs.forward import spec_from_dict

        return spec_from_dict(fields)

    def simt_row(self, shape: Shape, peer: str, sets: list, ref: Any) -> dict[str, Any]:
        if shape.seqlen_q > self.args.simt_max_seqlen:
            reason = f"seqlen {shape.seqlen_q} > --simt-max-seqlen {self.args.simt_max_seqlen}"
            return report.make_row(shape, peer, report.SKIPPED, reason=reason)

        def make() -> Any:
            base = self.base_fields(shape)
            spec = self.spec_from(v1_fields(base) if peer == "kg-simt-v1" else base)
            self.compiled(spec)
            return self.gpu.kernelgen_impl(self.env, peer, spec, shape.causal)

        row = self.guarded(shape, peer, make, sets, ref)
        if row.get("spec_uri") in self.compile_s:
            row["compile_s"] = round(self.compile_s[row["spec_uri"]], 3)
        return row

    def wgmma_row(self, shape: Shape, sets: list, ref: Any) -> dict[str, Any]:
        """The Hopper kernels (sm_90a code runs on compute capability 9.0 only), best of N."""
        if self.env.arch != "sm_90":
            reason = (
                f"wgmma (sm_90a) runs on compute capability 9.0 only; this GPU is {self.env.arch}"
            )
            return report.make_row(shape, "kg-wgmma", report.UNAVAILABLE, reason=reason)
        base = identity(self.base_fields(shape))
        hopper = wgmma_candidates(quick=self.quick, head_dim=shape.head_dim)
        listed = [(candidate_label(o), spec_fields(base, o)) for o in hopper]
        return self.tensor_core_row(shape, sets, ref, "kg-wgmma", listed)

    def fp8_row(self, shape: Shape, sets: list) -> dict[str, Any]:
        """The fp8 (e4m3) wgmma kernel's loops (bench.candidates.fp8_candidates), best of them,
        on the bf16 sets rounded to e4m3 (outside the timed region) and checked against the
        reference of those rounded inputs within the fp8 tolerance (bench.metrics)."""
        from kernelgen.specs.forward import FP8_HEAD_DIMS

        reason = None
        if self.env.arch != "sm_90":
            reason = (
                f"fp8 wgmma (sm_90a) runs on compute capability 9.0 only; this GPU is "
                f"{self.env.arch}"
            )
        elif shape.dtype != "bfloat16" or shape.head_dim not in FP8_HEAD_DIMS:
            reason = f"fp8 rows quantize bf16 shapes at head dim {FP8_HEAD_DIMS}"
        if reason is not None:
            return report.make_row(shape, FP8_PEER, report.UNAVAILABLE, reason=reason)
        quantized = self.gpu.quantize_sets(self.env, sets)
        ref = self.gpu.reference(self.env, *quantized[id(sets[0][0])], shape.causal)
        base = identity(self.base_fields(shape))
        listed = [
            (candidate_label(o), spec_fields(base, o)) for o in fp8_candidates(shape.head_dim)
        ]

        def make_impl(spec: Any) -> Any:
            return self.gpu.kernelgen_fp8_impl(self.env, FP8_PEER, spec, shape.causal, quantized)

        return self.tensor_core_row(shape, sets, ref, FP8_PEER, listed, make_impl)

    def tensor_core_row(
        self,
        shape: Shape,
        sets: list,
        ref: Any,
        peer: str = "kg-tc-v2",
        listed: list[tuple[str, dict]] | None = None,
        make_impl: Callable[[Any], Any] | None = None,
    ) -> dict[str, Any]:
        """The best of the tensor-core candidates (``listed``, default :meth:`candidate_list`);
        ``make_impl``: a spec's implementation (default: kernelgen.attention with the spec)."""
        from kernelgen.errors import SpecError

        gpu = self.gpu
        base = self.base_fields(shape)
        tried: list[dict[str, Any]] = []
        seen: set[str] = set()
        for label, fields in listed if listed is not None else self.candidate_list(shape, base):
            entry: dict[str, Any] = {"label": label, "fields": fields}
            try:
                spec = self.spec_from(fields)
            except SpecError as exc:
                tried.append(entry)
                entry.update(status="invalid", reason="; ".join(exc.problems))
                continue
            if spec.uri in seen:  # the default is often one of the grid's candidates
                continue
            seen.add(spec.uri)
            tried.append(entry)
            entry["spec_uri"] = spec.uri
            try:
                self.compiled(spec)
                entry["compile_s"] = round(self.compile_s[spec.uri], 3)
                if make_impl is not None:
                    impl = make_impl(spec)
                else:
                    impl = gpu.kernelgen_impl(self.env, peer, spec, shape.causal)
                status, figures = self.measure(shape, impl, sets, ref, CANDIDATE_BUDGET_MS)
            except gpu.FatalGPUError:
                raise
            except Exception as exc:
                self.env.sync()
                entry.update(status=report.ERROR, reason=gpu.first_line(exc))
                continue
            entry.update(status=status, **figures)
            entry["impl"] = impl
        self.time_pending(tried)  # the screening: the candidates interleaved, in rounds
        return self.best_candidate(shape, peer, tried, sets, ref)

    def best_candidate(
        self, shape: Shape, peer: str, tried: list[dict[str, Any]], sets: list, ref: Any
    ) -> dict[str, Any]:
        timed = [c for c in tried if c.get("status") == report.OK]
        impls = {c["label"]: c.pop("impl") for c in tried if "impl" in c}
        label = f"best of {len(timed)} timed specs ({len(tried)} tried)"
        if not timed:
            return self.no_candidate(shape, peer, tried)
        best = min(timed, key=lambda c: c["median_ms"])
        # Re-time the winner on the full budget so it gets the same care as the other peers.
        status, fields = self.measure(shape, impls[best["label"]], sets, ref)
        return report.make_row(
            shape, peer, status, **fields, label=label, best_label=best["label"], candidates=tried
        )

    def no_candidate(self, shape: Shape, peer: str, tried: list[dict[str, Any]]) -> dict:
        wrong = [c for c in tried if c.get("status") == report.WRONG]
        if wrong:
            errs = [c["rel_err"] for c in wrong if c.get("rel_err") is not None]
            return report.make_row(
                shape,
                peer,
                report.WRONG,
                rel_err=min(errs) if errs else None,
                reason=f"all {len(wrong)} checked candidates failed the correctness check",
                candidates=tried,
            )
        if tried and all(c.get("status") == "invalid" for c in tried):
            reason = f"no candidate spec validates ({tried[0]['reason'][:200]})"
            return report.make_row(shape, peer, report.UNAVAILABLE, reason=reason, candidates=tried)
        errors = [c.get("reason", "") for c in tried if c.get("status") == report.ERROR]
        reason = errors[0] if errors else "no candidates"
        return report.make_row(shape, peer, report.ERROR, reason=reason, candidates=tried)

    def shape_rows(self, shape: Shape) -> list[dict[str, Any]]:
        """Every selected peer on one shape (inputs, reference, then each peer in turn)."""
        gpu, env = self.gpu, self.env
        set_bytes = metrics.input_set_bytes(shape)
        n_sets = metrics.rotation_count(env.info.get("l2_bytes"), set_bytes)
        seed = self.args.seed * 1000 + zlib.crc32(shape.key.encode()) % 1000
        sets = gpu.make_sets(env, shape, n_sets, seed)
        ref = gpu.reference(env, *sets[0], shape.causal)
        rows = []
        kernelgen_missing = env.kernelgen is None
        backends = {v: k for k, v in gpu.BACKEND_PEERS.items()}
        for peer in self.peers:
            try:
                if peer.startswith("torch-"):
                    row = self.torch_row(shape, backends[peer.split("-", 1)[1]], sets, ref)
                elif peer == "cupy-naive":
                    row = self.naive_row(shape, sets, ref)
                elif kernelgen_missing:
                    reason = env.kernelgen_error
                    row = report.make_row(shape, peer, report.UNAVAILABLE, reason=reason)
                elif peer == "kg-tc-v2":
                    row = self.tensor_core_row(shape, sets, ref)
                elif peer == "kg-wgmma":
                    row = self.wgmma_row(shape, sets, ref)
                elif peer == FP8_PEER:
                    row = self.fp8_row(shape, sets)
                else:
                    row = self.simt_row(shape, peer, sets, ref)
            except gpu.FatalGPUError:
                raise
            except Exception as exc:
                env.sync()
                row = report.make_row(shape, peer, report.ERROR, reason=gpu.first_line(exc))
            row.setdefault("label", PEERS_BY_NAME[peer].label)
            row["n_sets"] = n_sets
            rows.append(row)
        self.time_pending(rows)  # every checked peer (and each best candidate), interleaved
        for row in rows:
            print(progress_line(row), flush=True)
        del sets, ref
        gpu.release(env)
        return rows


def progress_line(row: dict[str, Any]) -> str:
    tflops = f"{row['tflops']:8.1f} TFLOP/s" if row.get("tflops") else " " * 16
    median = f"{row['median_ms']:9.4f} ms" if row.get("median_ms") else " " * 12
    reason = f"  {str(row.get('reason'))[:70]}" if row["status"] != report.OK else ""
    return f"{row['shape']:26} {row['peer']:16} {row['status']:11} {median} {tflops}{reason}"


# ---- the run ------------------------------------------------------------------------------------
def run(args: argparse.Namespace, shapes: list[Shape]) -> int:
    from bench import gpu

    env = open_env()
    if env is None:
        return 2
    kg = env.kernelgen
    today = dt.date.today()
    meta: dict[str, Any] = {
        "date": today.isoformat(),
        **env.info,
        "kernelgen_version": getattr(kg, "__version__", None) if kg else None,
        "kernelgen_error": env.kernelgen_error,
        "template_hash": env.kg_module("kernels.render").template_hash() if kg else None,
        **git_info(),
        "clocks_start": gpu_clocks(),
        "python": sys.version.split()[0],
        "timing": gpu.TIMING_METHOD,
        "memory_method": gpu.MEMORY_METHOD,
        "reference": "torch SDPA math backend in fp32 (TF32 off) on upcast inputs, "
        "chunked over (batch, head); relative Frobenius error",
    }
    settings = run_settings(
        args,
        shapes,
        candidate_budget_ms=CANDIDATE_BUDGET_MS,
        timing_rounds=args.rounds,
        tensor_core_candidates=tensor_core_candidates(args.quick),
    )
    runner = Runner(env, args, floors={})
    print(f"bench: {env.info['gpu_name']}, {len(shapes)} shapes, peers {','.join(runner.peers)}")
    floors = gpu.measure_floors(env, runner.timer)
    runner.floors = floors
    print(
        f"floors: copy {floors['copy_gbps']:.0f} GB/s, matmul bf16 "
        f"{floors['matmul_tflops']['bfloat16']:.0f} / fp16 "
        f"{floors['matmul_tflops']['float16']:.0f} TFLOP/s",
        flush=True,
    )
    paths = report.result_paths(args.out, report.result_stem(today, env.info["gpu_name"], args.tag))
    previous = load_previous(paths["json"]) if args.merge else []

    def checkpoint(rows: list[dict[str, Any]]) -> None:
        meta["compile_s"] = runner.compile_s
        write_results(paths, meta, floors, report.merge_rows(previous, rows), settings, png=False)

    rows, fatal = run_shapes(shapes, lambda shape: shape_or_error(runner, shape), checkpoint)
    meta["fatal"] = fatal
    meta["clocks_end"] = gpu_clocks()
    all_rows = report.merge_rows(previous, rows)
    written = write_results(paths, meta, floors, all_rows, settings, png=True)
    for path in written:
        print(f"wrote {path}")
    print()
    print(report.markdown_table(all_rows, compact=True))
    return 1 if fatal else 0


def write_results(
    paths: dict[str, Path],
    meta: dict[str, Any],
    floors: dict[str, Any],
    rows: list[dict[str, Any]],
    settings: dict[str, Any],
    png: bool,
) -> list[Path]:
    """Write the .json and .md (and with ``png`` the plot); the paths written."""
    result = report.build_result(meta, floors, rows, settings)
    report.write_atomic(paths["json"], report.to_json(result))
    report.write_atomic(paths["md"], report.markdown_document(result))
    written = [paths["json"], paths["md"]]
    if png:
        try:
            from bench.plot import plot_png

            title = f"attention forward, {meta.get('gpu_name')}, {meta.get('date')}"
            report.write_atomic(paths["png"], plot_png(rows, title))
            written.append(paths["png"])
        except ImportError:
            print("bench: matplotlib is not installed; skipped the png")
        except ValueError as exc:
            print(f"bench: skipped the png ({exc})")
    return written


def list_plan(shapes: list[Shape], args: argparse.Namespace) -> None:
    print(f"{len(shapes)} shapes (batch x heads x seqlen x head_dim, dtype, causal):")
    for s in shapes:
        gflop = metrics.shape_flops(s) / 1e9
        print(
            f"  {s.key:26} B={s.batch:<3} H={s.heads:<2} S={s.seqlen_q:<5} D={s.head_dim:<3} "
            f"{gflop:9.1f} GFLOP  {metrics.input_set_bytes(s) / 2**20:7.1f} MiB/set"
        )
    print("tensor-core candidates:")
    for c in tensor_core_candidates(args.quick):
        print(f"  {candidate_label(c)}")
    from kernelgen.specs.forward import FP8_HEAD_DIMS

    print(f"fp8 candidates (kg-wgmma-fp8, bf16 shapes at head dims {FP8_HEAD_DIMS}):")
    for d in FP8_HEAD_DIMS:
        print(f"  d{d}: {', '.join(candidate_label(c) for c in fp8_candidates(d))}")
    print(f"peers: {', '.join(selected_peers(args.peers))}")


def is_decode_flag(arg: str) -> bool:
    """``--decode`` or an abbreviation argparse would take for it (``--de``, ``--dec``, ...)."""
    return len(arg) >= 4 and "--decode".startswith(arg)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if any(is_decode_flag(a) for a in argv):
        from bench import decode

        return decode.main([a for a in argv if not is_decode_flag(a)])
    args = parse_args(argv)
    try:
        shapes = grid(
            quick=args.quick,
            dtypes=args.dtype,
            head_dims=args.head_dim,
            seqlens=args.seqlen,
            causal=args.causal,
            tokens=args.tokens,
        )
        selected_peers(args.peers)
    except ValueError as exc:
        print(f"bench: {exc}", file=sys.stderr)
        return 2
    if not shapes:
        print("bench: no shapes selected", file=sys.stderr)
        return 2
    if args.list:
        list_plan(shapes, args)
        return 0
    return run(args, shapes)


if __name__ == "__main__":
    sys.exit(main())
