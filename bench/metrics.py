"""Pure arithmetic of the benchmark: FLOPs, bytes, floors, statistics, tolerances, rotation."""

from __future__ import annotations

import math
from collections.abc import Sequence

from bench.decode_shapes import DecodeShape
from bench.shapes import Shape

DEFAULT_L2_BYTES = 50 * 1024 * 1024
# Relative Frobenius error allowed against the fp32 reference (bf16 has 8 mantissa bits, fp16 11).
TOLERANCE = {"bfloat16": 2e-2, "float16": 5e-3, "float32": 1e-4}


def effective_keys(seqlen_q: int, seqlen_k: int, causal: bool) -> float:
    """Keys each query sees on average: Sk, or for causal ``(max(0, Sk - Sq) + Sk) / 2``.

    FlashAttention's benchmark convention (docs/design.md); for Sq = Sk causal it is Sk / 2."""
    if not causal:
        return float(seqlen_k)
    return (max(0, seqlen_k - seqlen_q) + seqlen_k) / 2


def attention_flops(
    batch: int, heads: int, seqlen_q: int, seqlen_k: int, head_dim: int, causal: bool
) -> float:
    """Forward FLOPs: two matrix products of 2 * Sq * Sk_eff * D each, per batch and head."""
    return 4.0 * batch * heads * seqlen_q * head_dim * effective_keys(seqlen_q, seqlen_k, causal)


def shape_flops(shape: Shape) -> float:
    return attention_flops(
        shape.batch, shape.heads, shape.seqlen_q, shape.seqlen_k, shape.head_dim, shape.causal
    )


def lse_bytes(shape: Shape) -> int:
    """Bytes of the fp32 log-sum-exp, (B, H, Sq): the most extra memory a kernelgen call may use."""
    return 4 * shape.batch * shape.heads * shape.seqlen_q


def tensor_bytes(shape: Shape | DecodeShape) -> dict[str, int]:
    """Bytes of q, k and v (``kv_heads`` heads) and out."""
    q = shape.batch * shape.heads * shape.seqlen_q * shape.head_dim * shape.elem_bytes
    kv = shape.batch * shape.kv_heads * shape.seqlen_k * shape.head_dim * shape.elem_bytes
    return {"q": q, "k": kv, "v": kv, "out": q}


def input_set_bytes(shape: Shape) -> int:
    """Bytes of one (q, k, v) input set."""
    sizes = tensor_bytes(shape)
    return sizes["q"] + sizes["k"] + sizes["v"]


def min_bytes(shape: Shape) -> int:
    """Fewest bytes a forward pass moves: q, k, v read once, out and the fp32 LSE written once."""
    return sum(tensor_bytes(shape).values()) + lse_bytes(shape)


def naive_score_bytes(shape: Shape) -> int:
    """Bytes of the fp32 score matrix (B, H, Sq, Sk) the naive peer materializes."""
    return 4 * shape.batch * shape.heads * shape.seqlen_q * shape.seqlen_k


def tflops(flops: float, ms: float | None) -> float | None:
    """TFLOP/s for ``flops`` done in ``ms`` milliseconds (None when there is no time)."""
    if ms is None or ms <= 0 or not math.isfinite(ms):
        return None
    return flops / (ms * 1e-3) / 1e12


def floor_ms(flops: float, nbytes: float, tflops_peak: float | None, bytes_per_s: float | None):
    """(compute floor, memory floor) in ms; either is None when its ceiling is unknown."""
    compute = flops / (tflops_peak * 1e12) * 1e3 if tflops_peak else None
    memory = nbytes / bytes_per_s * 1e3 if bytes_per_s else None
    return compute, memory


def rotation_count(
    l2_bytes: int | None, set_bytes: int, factor: float = 2.0, minimum: int = 2, maximum: int = 64
) -> int:
    """Input sets to cycle through so that together they exceed ``factor`` times the L2 size.

    At least ``minimum`` (consecutive calls never reuse the same buffers), at most ``maximum``."""
    if set_bytes <= 0:
        raise ValueError(f"set_bytes={set_bytes} must be positive")
    l2 = l2_bytes if l2_bytes and l2_bytes > 0 else DEFAULT_L2_BYTES
    needed = math.floor(factor * l2 / set_bytes) + 1
    return max(minimum, min(maximum, needed))


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation between closest ranks."""
    if not values:
        raise ValueError("percentile of no values")
    if not 0 <= q <= 100:
        raise ValueError(f"q={q} must be within 0..100")
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def summarize(times_ms: Sequence[float]) -> dict[str, float | int]:
    """Median, p10, p90, min, max (ms) and the count of a list of timings."""
    return {
        "median_ms": percentile(times_ms, 50),
        "p10_ms": percentile(times_ms, 10),
        "p90_ms": percentile(times_ms, 90),
        "min_ms": min(times_ms),
        "max_ms": max(times_ms),
        "reps": len(times_ms),
    }


def repetitions(
    estimate_ms: float, budget_ms: float, min_reps: int = 20, max_reps: int = 500
) -> int:
    """Timed repetitions for a kernel taking about ``estimate_ms``: fill the budget, within
    ``[min_reps, max_reps]`` (``min_reps`` wins over the budget for slow kernels)."""
    if estimate_ms <= 0:
        return max_reps
    return max(min_reps, min(max_reps, math.ceil(budget_ms / estimate_ms)))


def tolerance(dtype: str) -> float:
    return TOLERANCE[dtype]


# ---- decode (bench.decode) ---------------------------------------------------------------------
DECODE_BYTES_MODEL = (
    "bytes moved = K and V read once (B * Hkv * Sk * D * elem each) + Q read and O written once "
    "(B * H * Sq * D * elem each); achieved GB/s = bytes moved / median time; frac_of_copy = "
    "achieved GB/s / measured device-to-device copy GB/s (which also counts reads + writes)"
)


def decode_kv_bytes(shape: DecodeShape) -> int:
    """Bytes of K plus V: the KV cache a decode step reads."""
    sizes = tensor_bytes(shape)
    return sizes["k"] + sizes["v"]


def decode_set_bytes(shape: DecodeShape) -> int:
    """Bytes of one (q, k, v) input set."""
    return decode_kv_bytes(shape) + tensor_bytes(shape)["q"]


def decode_bytes_moved(shape: DecodeShape) -> int:
    """The bytes model of a decode step (:data:`DECODE_BYTES_MODEL`): q, k, v read, out written."""
    return sum(tensor_bytes(shape).values())


def decode_flops(shape: DecodeShape) -> float:
    """``4 * B * H * Sq * Sk * D`` (non-causal)."""
    return attention_flops(
        shape.batch, shape.heads, shape.seqlen_q, shape.seqlen_k, shape.head_dim, causal=False
    )


def gbps(nbytes: float, ms: float | None) -> float | None:
    """GB/s (1e9 bytes per second) for ``nbytes`` moved in ``ms`` (None when there is no time)."""
    if ms is None or ms <= 0 or not math.isfinite(ms):
        return None
    return nbytes / (ms * 1e-3) / 1e9


def fraction(value: float | None, ceiling: float | None) -> float | None:
    """``value / ceiling``, None when either is missing or the ceiling is not positive."""
    if value is None or not ceiling or ceiling <= 0:
        return None
    return value / ceiling


def decode_figures(shape: DecodeShape, median_ms: float, copy_gbps: float | None) -> dict:
    """Bytes, FLOPs, achieved GB/s, its fraction of the measured copy bandwidth, TFLOP/s and the
    memory floor (bytes moved at the copy bandwidth) of one timed decode row."""
    moved = decode_bytes_moved(shape)
    flops = decode_flops(shape)
    achieved = gbps(moved, median_ms)
    _, memory_ms = floor_ms(flops, moved, None, copy_gbps * 1e9 if copy_gbps else None)
    return {
        "bytes_moved": moved,
        "flops": flops,
        "achieved_gbps": achieved,
        "frac_of_copy": fraction(achieved, copy_gbps),
        "tflops": tflops(flops, median_ms),
        "memory_floor_ms": memory_ms,
    }
