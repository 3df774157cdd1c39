"""``python -m kernelgen.selfcheck``: a few small attention calls on this GPU against float64
NumPy, for a first check of an install and for compute-sanitizer (bench/gpu_session.sh).

Runs, without tuning: a prefill call (GQA, causal, ragged lengths) on the default tensor-core
spec, and a split-KV decode call with per-sequence key lengths (zeros and ones among them) at
a few split counts. Prints one line per call; exits 1 when any is wrong, 2 without a GPU.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

import numpy as np

from kernelgen.errors import KernelgenError
from kernelgen.reference import naive_attention, relative_error

TOLERANCE = {"float16": 5e-3, "bfloat16": 2e-2}  # relative Frobenius error of out


def check_call(
    shape: tuple[int, int, int, int, int, int],
    dtype: str,
    *,
    causal: bool = False,
    seqlens_k: Sequence[int] | None = None,
    num_splits: int | None = None,
    seed: int = 0,
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
    out = kernelgen.attention(q, k, v, causal=causal, seqlens_k=seqlens_k, num_splits=num_splits)
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


def main(argv: Sequence[str] | None = None) -> int:
    os.environ.setdefault("KERNELGEN_AUTOTUNE", "0")  # the heuristic specs: no tuning run
    dtypes = list(argv) if argv else ["float16", "bfloat16"]
    unknown = [d for d in dtypes if d not in TOLERANCE]
    if unknown:
        print(f"selfcheck: dtype {unknown[0]!r} is not allowed; use float16 or bfloat16")
        return 2
    try:
        from kernelgen.tuning.gpu import require_device

        require_device()
    except KernelgenError as exc:
        print(f"selfcheck: {str(exc).splitlines()[0]}")
        return 2
    failed = 0
    for dtype in dtypes:
        for seed, (label, kwargs) in enumerate(CALLS):
            try:
                err = check_call(dtype=dtype, seed=seed, **kwargs)
            except KernelgenError as exc:
                print(f"{dtype:9} {label:20} error: {str(exc).splitlines()[0]}")
                failed += 1
                continue
            ok = err <= TOLERANCE[dtype]
            failed += not ok
            print(f"{dtype:9} {label:20} rel. error {err:.2e} {'ok' if ok else 'WRONG'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
