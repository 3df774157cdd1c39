"""``python -m kernelgen.selfcheck [--engines simt,mma_sync,wgmma] [--dry-run] [DTYPE ...]``: a few
small attention calls on this GPU against float64 NumPy, for a first check of an install and
for compute-sanitizer (``python -m bench.session``).

Runs, without tuning: a prefill call (GQA, causal, ragged lengths) on the default tensor-core
spec, split-KV decode calls with per-sequence key lengths (zeros and ones among them) at a few
split counts, and the same prefill call on the policy's default of each engine asked for with
``--engines`` (CUDA cores, mma.sync, and wgmma on compute capability 9.0 devices). Prints one
line per call; exits 1 when any is wrong, 2 without a GPU. ``--dry-run`` builds and compiles
(offline, NVRTC) the engines' specs for sm_90a / sm_90 without a GPU.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

import numpy as np

from kernelgen.errors import KernelgenError
from kernelgen.references.attention import naive_attention, relative_error
from kernelgen.specs.forward import KernelSpec

TOLERANCE = {"float16": 5e-3, "bfloat16": 2e-2}  # relative Frobenius error of out


def check_call(
    shape: tuple[int, int, int, int, int, int],
    dtype: str,
    *,
    causal: bool = False,
    seqlens_k: Sequence[int] | None = None,
    num_splits: int | None = None,
    seed: int = 0,
    spec: KernelSpec | None = None,
) -> float:
    """One attention() call of (B, H, Hkv, Sq, Sk, D) on fresh normal inputs against float64;
    its relative error (inf for a non-finite output)."""
    import cupy

    import kernelgen
    from kernelgen.tuning.gpu import as_float32, upload

    batch, heads, kv_heads, seqlen_q, seqlen_k, head_dim = shape
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((batch, heads, seqlen_q, head_dim))
    k = rng.standard_normal((batch, kv_heads, seqlen_k, head_dim))
    v = rng.standard_normal((batch, kv_heads, seqlen_k, head_dim))
    q, k, v = (upload(cupy, x, dtype) for x in (q, k, v))
    out = kernelgen.attention(
        q, k, v, causal=causal, seqlens_k=seqlens_k, num_splits=num_splits, spec=spec
    )
    group = heads // kv_heads
    host = [as_float32(cupy, x).get().astype(np.float64) for x in (q, k, v)]
    host[1], host[2] = (np.repeat(x, group, axis=1) for x in host[1:])
    ref, _ = naive_attention(*host, causal=causal, seqlens_k=seqlens_k)
    got = as_float32(cupy, out).get().astype(np.float64)
    if not np.isfinite(got).all():
        return float("inf")
    return relative_error(got, ref)


CALLS: tuple[tuple[str, dict], ...] = (
    ("prefill gqa causal", {"shape": (2, 8, 2, 77, 130, 128), "causal": True}),
    (
        "decode split x7",
        {"shape": (4, 32, 8, 1, 1000, 128), "seqlens_k": [0, 1, 999, 512], "num_splits": 7},
    ),
    ("decode split x64", {"shape": (1, 32, 4, 2, 4099, 64), "num_splits": 64}),
    ("decode heuristic", {"shape": (2, 16, 16, 1, 3000, 128), "causal": True}),
)


ENGINES: tuple[str, ...] = ("simt", "mma_sync", "wgmma")
ENGINE_CALL = CALLS[0][1]  # the prefill call: GQA, causal, lengths that fill no tile


def engine_spec(engine: str, dtype: str) -> KernelSpec:
    """What an untuned :data:`ENGINE_CALL` runs on an H100 with ``engine`` (head dim 128,
    causal): the policy's default of that engine, for sm_90 (sm_90a for wgmma)."""
    from kernelgen.model.policy import HOPPER_DEVICE_ARCH, default_spec, hopper_default_spec

    head_dim, causal = ENGINE_CALL["shape"][-1], ENGINE_CALL["causal"]
    if engine == "wgmma":
        return hopper_default_spec(dtype, head_dim, causal)
    tensor_cores = engine == "mma_sync"
    return default_spec(dtype, head_dim, causal, HOPPER_DEVICE_ARCH, tensor_cores=tensor_cores)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m kernelgen.selfcheck")
    p.add_argument("dtypes", nargs="*", default=["float16", "bfloat16"])
    p.add_argument("--engines", default="", help=f"comma-separated: {', '.join(ENGINES)}")
    p.add_argument("--dry-run", action="store_true", help="compile the engines' specs, no GPU")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    os.environ.setdefault("KERNELGEN_AUTOTUNE", "0")  # the heuristic specs: no tuning run
    args = parse_args(argv)
    dtypes = args.dtypes
    engines = [e for e in args.engines.split(",") if e]
    unknown = [d for d in dtypes if d not in TOLERANCE]
    if unknown:
        print(f"selfcheck: dtype {unknown[0]!r} is not allowed; use float16 or bfloat16")
        return 2
    bad = [e for e in engines if e not in ENGINES]
    if bad:
        print(f"selfcheck: engine {bad[0]!r} is not allowed; use {', '.join(ENGINES)}")
        return 2
    if args.dry_run:
        return dry_run(dtypes, engines)
    try:
        from kernelgen.tuning.gpu import require_device

        require_device()
    except KernelgenError as exc:
        print(f"selfcheck: {str(exc).splitlines()[0]}")
        return 2
    calls = [(label, kwargs, None) for label, kwargs in CALLS]
    failed = 0
    for dtype in dtypes:
        specs = [(f"{e} prefill", ENGINE_CALL, e) for e in engines]
        for seed, (label, kwargs, engine) in enumerate(calls + specs):
            if engine == "wgmma" and not _runs_wgmma():
                print(f"{dtype:9} {label:20} skipped: wgmma needs compute capability 9.0")
                continue
            spec = engine_spec(engine, dtype) if engine else None
            try:
                err = check_call(dtype=dtype, seed=seed, spec=spec, **kwargs)
            except KernelgenError as exc:
                print(f"{dtype:9} {label:20} error: {str(exc).splitlines()[0]}")
                failed += 1
                continue
            ok = err <= TOLERANCE[dtype]
            failed += not ok
            print(f"{dtype:9} {label:20} rel. error {err:.2e} {'ok' if ok else 'WRONG'}")
    return 1 if failed else 0


def _runs_wgmma() -> bool:
    from kernelgen.calls.attention import device_arch
    from kernelgen.model.policy import HOPPER_DEVICE_ARCH

    return device_arch()[1] == HOPPER_DEVICE_ARCH


def dry_run(dtypes: Sequence[str], engines: Sequence[str]) -> int:
    """Build each engine's spec and compile it offline (NVRTC): what a GPU run would launch."""
    from kernelgen.kernels.compile import compile_offline
    from kernelgen.kernels.render import render

    failed = 0
    for dtype in dtypes:
        for engine in engines:
            spec = engine_spec(engine, dtype)
            (arch,) = spec.archs
            try:
                res = compile_offline(render(spec), spec.uri, arch, sass=False).resources
            except KernelgenError as exc:
                print(f"{dtype:9} {engine:9} {spec.uri}: {str(exc).splitlines()[0]}")
                failed += 1
                continue
            print(
                f"{dtype:9} {engine:9} {spec.uri}: compiles for {arch}, {res.registers} registers"
            )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
