"""Pure arithmetic of the benchmark: FLOPs, bytes, floors, statistics, timing rounds and the
verdicts they allow, rank correlation, tolerances, rotation."""

from __future__ import annotations

import math
from collections.abc import Sequence

from bench.decode_shapes import DecodeShape
from bench.shapes import OUT_ELEM_BYTES, Shape

DEFAULT_L2_BYTES = 50 * 1024 * 1024
# Relative Frobenius error allowed against the fp32 reference (bf16 has 8 mantissa bits, fp16 11).
# fp8 (e4m3) rows: against the reference of the quantized inputs, the fp8 tests' bound on the
# relative Frobenius error (2^-4: e4m3's rounding of the weights; docs/hopper.md, fp8).
TOLERANCE = {"bfloat16": 2e-2, "float16": 5e-3, "float32": 1e-4, "float8_e4m3": 2.0**-4}


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
    """Bytes of q, k and v (``kv_heads`` heads) and out (fp8 inputs: bf16 out)."""
    q_elems = shape.batch * shape.heads * shape.seqlen_q * shape.head_dim
    kv = shape.batch * shape.kv_heads * shape.seqlen_k * shape.head_dim * shape.elem_bytes
    out = q_elems * OUT_ELEM_BYTES.get(shape.dtype, shape.elem_bytes)
    return {"q": q_elems * shape.elem_bytes, "k": kv, "v": kv, "out": out}


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


def rotation(count: int, round_index: int) -> list[int]:
    """The order of ``count`` entries in round ``round_index``: round r starts at entry
    ``r mod count`` and wraps, so that over ``count`` rounds every entry runs once in every
    position (a drift in clocks or temperature during a round is not charged to one entry)."""
    if count < 0 or round_index < 0:
        raise ValueError(f"count={count} and round_index={round_index} must be >= 0")
    return [(round_index + i) % count for i in range(count)]


def round_budget(budget_ms: float, rounds: int) -> float:
    """Each round's share of a measurement's time budget: the total stays ``budget_ms``."""
    if rounds < 1:
        raise ValueError(f"rounds={rounds} must be at least 1")
    return budget_ms / rounds


def round_min_reps(min_reps: int, rounds: int) -> int:
    """Each round's minimum repetitions: ``min_reps`` spread over the rounds (at least 1)."""
    if rounds < 1:
        raise ValueError(f"rounds={rounds} must be at least 1")
    return max(1, math.ceil(min_reps / rounds))


def round_stats(rounds: Sequence[Sequence[float]]) -> dict[str, float | int | list[float]]:
    """Figures over every repetition of every round (:func:`summarize`) plus each round's
    median (``round_medians_ms``) and the spread between rounds (``round_spread``: the largest
    minus the smallest round median, over the median of all repetitions)."""
    kept = [list(times) for times in rounds if times]
    if not kept:
        raise ValueError("round statistics of no timings")
    stats: dict[str, float | int | list[float]] = dict(summarize([t for r in kept for t in r]))
    medians = [percentile(times, 50) for times in kept]
    stats["rounds"] = len(kept)
    stats["round_medians_ms"] = medians
    median = float(stats["median_ms"])
    stats["round_spread"] = (max(medians) - min(medians)) / median if median > 0 else None
    return stats


NOISE_ROUNDS, NOISE_P10_P90 = "round spread", "p10-p90"
WIN, LOSS, WITHIN_NOISE = "win", "loss", "within noise"


def relative_noise(row: dict) -> tuple[float | None, str | None]:
    """(noise, what it is) of a timed row: its spread between rounds when it has rounds, else
    (a file written before rounds existed) the p10-p90 width over the median; (None, None)
    when neither can be computed."""
    spread = row.get("round_spread")
    if spread is not None and (row.get("rounds") or 0) > 1:
        return float(spread), NOISE_ROUNDS
    median, p10, p90 = row.get("median_ms"), row.get("p10_ms"), row.get("p90_ms")
    if median and p10 is not None and p90 is not None and median > 0:
        return (p90 - p10) / median, NOISE_P10_P90
    return None, None


def verdict(row: dict, other: dict) -> dict:
    """How ``row`` compares with ``other`` (two timed rows of one shape): ``ratio`` is other's
    median time over row's (above 1: row is faster), ``noise`` the two rows' noise added
    (:func:`relative_noise`), and ``call`` a win or a loss only when ``|ratio - 1|`` exceeds it,
    else within noise (None when either row has no time or no noise figure)."""
    mine, theirs = row.get("median_ms"), other.get("median_ms")
    if not mine or not theirs or mine <= 0 or theirs <= 0:
        return {"ratio": None, "noise": None, "noise_kind": None, "call": None}
    ratio = theirs / mine
    noise_a, kind_a = relative_noise(row)
    noise_b, kind_b = relative_noise(other)
    if noise_a is None or noise_b is None:
        return {"ratio": ratio, "noise": None, "noise_kind": None, "call": None}
    noise = noise_a + noise_b
    kind = kind_a if kind_a == kind_b else f"{kind_a} + {kind_b}"
    call = WITHIN_NOISE if abs(ratio - 1) <= noise else (WIN if ratio > 1 else LOSS)
    return {"ratio": ratio, "noise": noise, "noise_kind": kind, "call": call}


def spearman(xs: Sequence[float], ys: Sequence[float]) -> float | None:
    """Spearman's rank correlation of two equally long sequences (ties get their average rank);
    None for fewer than two pairs or when either side is constant."""
    if len(xs) != len(ys):
        raise ValueError(f"spearman of {len(xs)} against {len(ys)} values")
    if len(xs) < 2:
        return None
    rx, ry = average_ranks(xs), average_ranks(ys)
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    sxy = sum((a - mx) * (b - my) for a, b in zip(rx, ry, strict=True))
    sxx = sum((a - mx) ** 2 for a in rx)
    syy = sum((b - my) ** 2 for b in ry)
    if sxx == 0 or syy == 0:
        return None
    return sxy / math.sqrt(sxx * syy)


def average_ranks(values: Sequence[float]) -> list[float]:
    """1-based ranks of ``values`` (smallest first), tied values sharing their average rank."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    ranks = [0.0] * len(values)
    start = 0
    while start < len(order):
        end = start
        while end + 1 < len(order) and values[order[end + 1]] == values[order[start]]:
            end += 1
        for k in range(start, end + 1):
            ranks[order[k]] = (start + end) / 2 + 1
        start = end + 1
    return ranks


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
