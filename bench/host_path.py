"""Host time of kernelgen.attention() itself, with CuPy replaced by a stand-in that allocates and
launches nothing (kernelgen/testing/fake_cupy.py): what kernelgen's Python adds to a call, on
any machine. The autotuner's target (a cached call adds under 15 us over launching the kernel
directly) is measured on a GPU by ``bench.tuning``; this is the part of it that does not need
one.

    python -m bench.host_path [--calls 5000]

Rows: a repeated call (the remembered plan: signature, outputs, argument lists) and the checked
path every first call of a signature takes (checks, spec choice, launch preparation), for CuPy
arrays and for torch tensors (kernelgen/testing/fake_torch.py: the stream lookup and allocations
are stand-ins too). The libraries' own costs (two or four allocations from their memory pools,
torch's current-stream lookup, the launch) come on top.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from collections.abc import Callable, Sequence

import numpy as np

from bench import tuning
from kernelgen.testing import fake_cupy, fake_torch

SHAPES = {  # (B, H, Hkv, Sq, Sk, D)
    "prefill b4 h16 4k d128": (4, 16, 16, 4096, 4096, 128),
    "decode b1 h32/8 32k d128": (1, 32, 8, 1, 32768, 128),
}


def per_call_us(call: Callable[[], object], calls: int, rounds: int = 5) -> float:
    """Median over ``rounds`` of bench.tuning's per-call host time (nothing to synchronise)."""
    return statistics.median(tuning.per_call_us(call, lambda: None, calls) for _ in range(rounds))


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=5000)
    args = parser.parse_args(argv)
    os.environ["KERNELGEN_AUTOTUNE"] = "0"  # the heuristic spec: no tuner, no GPU
    fake_cupy.install(lambda *launch: None)
    sys.modules["torch"] = fake_torch.module()
    import kernelgen
    from kernelgen.calls import attention as api

    print("| call | arrays | repeated (plan) us | checked path us |")
    print("| --- | --- | ---: | ---: |")
    for label, (b, h, hkv, sq, sk, d) in SHAPES.items():
        shapes = ((b, h, sq, d), (b, hkv, sk, d), (b, hkv, sk, d))
        for arrays, qkv in (
            ("cupy", tuple(fake_cupy.ndarray(s, np.float16) for s in shapes)),
            ("torch", tuple(fake_torch.Tensor(s, fake_torch.float16) for s in shapes)),
        ):
            repeated, checked = row(kernelgen.attention, api._CALL_PLANS, qkv, args.calls)
            print(f"| {label} | {arrays} | {repeated:.1f} | {checked:.1f} |")
    # a KV-cache decode step whose lengths live on the host (checked and uploaded every call)
    b, h, hkv, sq, sk, d = 8, 32, 8, 1, 32768, 128
    shapes = ((b, h, sq, d), (b, hkv, sk, d), (b, hkv, sk, d))
    qkv = tuple(fake_cupy.ndarray(s, np.float16) for s in shapes)
    lengths = {"seqlens_k": [sk - 17 * i for i in range(b)]}
    repeated, checked = row(kernelgen.attention, api._CALL_PLANS, qkv, args.calls, lengths)
    print(f"| decode b8 h32/8 32k d128, host seqlens_k | cupy | {repeated:.1f} | {checked:.1f} |")


def row(
    attention: Callable[..., object],
    plans: dict,
    qkv: tuple,
    calls: int,
    options: dict | None = None,
) -> tuple[float, float]:
    """(repeated, checked) host microseconds per call of ``attention(*qkv, **options)``."""
    options = options or {}
    attention(*qkv, **options)  # compiles (stub) and remembers the plan

    def checked() -> None:
        plans.clear()
        attention(*qkv, **options)

    repeated = per_call_us(lambda: attention(*qkv, **options), calls)
    return repeated, per_call_us(checked, max(1, calls // 5))


if __name__ == "__main__":
    main()
