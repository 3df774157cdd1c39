"""``python -m bench.serving``: variable-length prefill, packed (``attention_varlen``) against
the padded rectangle a batch of those sequences would otherwise be.

For each length mix of :data:`MIXES` (bf16 and fp16, causal and not): the sequences packed end
to end (q (total, H, D), k and v (total, Hkv, D), ``cu_seqlens`` int32 on the device), and the
same sequences padded to the longest, (B, H, S_max, D) with ``seqlens_k``; queries are padded
at the front so that the causal mask, aligned to the bottom right, lines up with each
sequence's own (Sq = Sk). Both are checked against an fp32 per-sequence reference (relative
Frobenius error over the real rows, tolerances as in bench.attention), then timed like every
benchmark here (bench.gpu.Timer). Figures: median ms, useful TFLOP/s (the FLOPs of the real
sequences only, causal halved), and varlen's speedup over padded. Writes
``<out>/<date>-<gpu>-serving.{json,md}``. ``--help`` and ``--list`` need no GPU.

The paged KV cache's rows are in ``bench.decode`` (peers ``kg-paged-16`` and ``kg-paged-256``).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench import metrics, report
from bench.harness import FULL_BUDGET_MS, QUICK_BUDGET_MS, ROOT, git_info, open_env

# Length mixes (tokens per sequence) of one prefill batch: a long prompt among short ones, a
# spread, and equal lengths (where packing can only lose: the control).
MIXES: dict[str, tuple[int, ...]] = {
    "one-long": (8192, 512, 256, 128, 64, 32, 17, 1),
    "spread": (4096, 3000, 2048, 1500, 1024, 700, 300, 100),
    "equal": (2048,) * 8,
}
HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
PEERS = ("kg-varlen", "kg-padded")


@dataclass(frozen=True)
class VarlenShape:
    """One benchmark shape: a length mix, dtype, causal, heads and head dim."""

    mix: str
    dtype: str
    causal: bool
    heads: int = HEADS
    kv_heads: int = KV_HEADS
    head_dim: int = HEAD_DIM

    @property
    def lengths(self) -> tuple[int, ...]:
        return MIXES[self.mix]

    @property
    def key(self) -> str:
        short = "bf16" if self.dtype == "bfloat16" else "fp16"
        return f"{short}-{self.mix}-h{self.heads}kv{self.kv_heads}-d{self.head_dim}" + (
            "-causal" if self.causal else ""
        )

    def as_dict(self) -> dict[str, Any]:
        return {
            "mix": self.mix,
            "lengths": list(self.lengths),
            "dtype": self.dtype,
            "causal": self.causal,
            "heads": self.heads,
            "kv_heads": self.kv_heads,
            "head_dim": self.head_dim,
        }


def useful_flops(shape: VarlenShape) -> float:
    """FLOPs of the real sequences: 4 * H * D * (Sq * Sk, halved when causal) summed."""
    pairs = sum(n * (n + 1) / 2 if shape.causal else n * n for n in shape.lengths)
    return 4.0 * shape.heads * shape.head_dim * pairs


def padded_flops(shape: VarlenShape) -> float:
    """FLOPs the padded rectangle computes if no tile is skipped (B * S_max^2 per head)."""
    longest = max(shape.lengths)
    pairs = longest * (longest + 1) / 2 if shape.causal else longest * longest
    return 4.0 * shape.heads * shape.head_dim * pairs * len(shape.lengths)


def padded_rows(lengths: Sequence[int]) -> tuple[list[int], list[int]]:
    """Where the packed rows go in the padded layout: (query row, key row) starts per sequence,
    as offsets into a (B * S_max) row space. Queries are padded at the front (their last
    ``n`` rows are real: causal aligned to the bottom right), keys at the back."""
    longest = max(lengths)
    queries = [b * longest + longest - n for b, n in enumerate(lengths)]
    keys = [b * longest for b in range(len(lengths))]
    return queries, keys


def grid(quick: bool) -> list[VarlenShape]:
    dtypes = ("bfloat16",) if quick else ("bfloat16", "float16")
    mixes = ("one-long", "equal") if quick else tuple(MIXES)
    return [
        VarlenShape(mix, dtype, causal)
        for dtype in dtypes
        for mix in mixes
        for causal in (True, False)
    ]


def markdown_table(rows: list[dict[str, Any]]) -> str:
    """One line per shape: each peer's ``ms (TFLOP/s)`` and varlen's speedup over padded."""
    by_shape: dict[str, dict[str, dict[str, Any]]] = {}
    for row in rows:
        by_shape.setdefault(row["shape"], {})[row["peer"]] = row
    lines = []
    for key, peers in by_shape.items():
        cells = [key]
        for peer in PEERS:
            row = peers.get(peer)
            if row is None or row["status"] != report.OK:
                cells.append(report.cell(row))
            else:
                cells.append(f"{row['median_ms']:.3g} ({row['tflops']:.0f})")
        varlen, padded = peers.get("kg-varlen"), peers.get("kg-padded")
        ratio = report.ratio(varlen, padded)
        cells.append(f"{ratio:.2f}x" if ratio is not None else "-")
        lines.append(cells)
    header = ["shape", *PEERS, "varlen/padded"]
    return report.md_table(header, lines, ["---", "---:", "---:", "---:"])


# ---- the GPU run ---------------------------------------------------------------------------
def make_inputs(env: Any, shape: VarlenShape, seed: int) -> dict[str, Any]:
    """Packed q, k, v and offsets, their padded copies and seqlens_k, on the device."""
    torch = env.torch
    dtype = getattr(torch, shape.dtype)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    total, lengths = sum(shape.lengths), shape.lengths
    batch, longest = len(lengths), max(lengths)

    def randn(*size: int) -> Any:
        return torch.empty(size, device="cuda", dtype=dtype).normal_(generator=gen)

    q = randn(total, shape.heads, shape.head_dim)
    k, v = (randn(total, shape.kv_heads, shape.head_dim) for _ in range(2))
    starts = [0]
    for n in lengths:
        starts.append(starts[-1] + n)
    cu = torch.tensor(starts, dtype=torch.int32, device="cuda")
    q_rows, k_rows = padded_rows(lengths)
    pq = torch.zeros((batch * longest, shape.heads, shape.head_dim), device="cuda", dtype=dtype)
    pk, pv = (torch.zeros_like(pq[:, : shape.kv_heads]) for _ in range(2))
    for b, n in enumerate(lengths):
        pq[q_rows[b] : q_rows[b] + n] = q[starts[b] : starts[b + 1]]
        pk[k_rows[b] : k_rows[b] + n] = k[starts[b] : starts[b + 1]]
        pv[k_rows[b] : k_rows[b] + n] = v[starts[b] : starts[b + 1]]
    view = (batch, longest)
    return {
        "packed": (q, k, v, cu),
        "padded": tuple(t.view(*view, *t.shape[1:]) for t in (pq, pk, pv)),
        "seqlens_k": torch.tensor(lengths, dtype=torch.int32, device="cuda"),
        "q_rows": q_rows,
        "starts": starts,
    }


def reference(env: Any, shape: VarlenShape, inputs: dict[str, Any]) -> Any:
    """fp32 attention of each packed sequence alone (total, H, D)."""
    from bench.gpu import exact_fp32

    torch = env.torch
    q, k, v, _ = inputs["packed"]
    out = torch.empty(q.shape, device="cuda", dtype=torch.float32)
    group = shape.heads // shape.kv_heads
    with exact_fp32(torch):
        for b, n in enumerate(shape.lengths):
            if n == 0:
                continue
            rows = slice(inputs["starts"][b], inputs["starts"][b + 1])
            qs = q[rows].float().transpose(0, 1)
            ks, vs = (t[rows].float().transpose(0, 1).repeat_interleave(group, 0) for t in (k, v))
            scores = qs @ ks.transpose(1, 2) / math.sqrt(shape.head_dim)
            if shape.causal:
                hidden = torch.ones(n, n, device="cuda", dtype=torch.bool).triu(1)
                scores = scores.masked_fill(hidden, -math.inf)
            out[rows] = (torch.softmax(scores, dim=-1) @ vs).transpose(0, 1)
    return out


def calls(env: Any, shape: VarlenShape, inputs: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """Each peer's (call, conversion of its output to the packed (total, H, D) row order); only
    the call is timed."""
    kg, torch = env.kernelgen, env.torch
    q, k, v, cu = inputs["packed"]
    longest = max(shape.lengths)

    def varlen() -> Any:
        with env.stream():
            return kg.attention_varlen(q, k, v, cu, cu, longest, longest, causal=shape.causal)

    def padded() -> Any:
        pq, pk, pv = inputs["padded"]
        with env.stream():
            return kg.attention(
                pq, pk, pv, layout="bshd", seqlens_k=inputs["seqlens_k"], causal=shape.causal
            )

    rows = zip(inputs["q_rows"], shape.lengths, strict=True)
    index = torch.cat([torch.arange(r, r + n) for r, n in rows]).cuda()

    def real_rows(out: Any) -> Any:
        return out.reshape(-1, *out.shape[2:])[index]

    return {"kg-varlen": (varlen, lambda out: out), "kg-padded": (padded, real_rows)}


def shape_rows(env: Any, timer: Any, shape: VarlenShape, seed: int) -> list[dict[str, Any]]:
    from bench import gpu

    inputs = make_inputs(env, shape, seed)
    ref = reference(env, shape, inputs)
    tol = metrics.tolerance(shape.dtype)
    rows = []
    for peer, (call, packed) in calls(env, shape, inputs).items():
        try:
            out = packed(call())
            env.sync()
            err, nonfinite = gpu.relative_error(env, out, ref)
            if err is None or err >= tol:
                why = f"{nonfinite} non-finite" if err is None else f"rel. error {err:.3g}"
                rows.append(_row(shape, peer, report.WRONG, rel_err=err, reason=why))
                continue
            times, info = timer.measure(lambda _i, call=call: call(), 1)
            stats = metrics.summarize(times)
            tflops = useful_flops(shape) / (stats["median_ms"] * 1e9)
            rows.append(
                _row(shape, peer, report.OK, rel_err=err, tflops=tflops, timing=info, **stats)
            )
        except gpu.FatalGPUError:
            raise
        except Exception as exc:
            env.sync()
            rows.append(_row(shape, peer, report.ERROR, reason=gpu.first_line(exc)))
    return rows


def _row(shape: VarlenShape, peer: str, status: str, **fields: Any) -> dict[str, Any]:
    return {"shape": shape.key, **shape.as_dict(), "peer": peer, "status": status, **fields}


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.serving", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="bf16, one-long and equal (4 shapes)")
    p.add_argument("--list", action="store_true", help="print the shapes and exit (no GPU)")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results", help="results folder")
    p.add_argument("--budget-ms", type=float, help="time budget per measurement (200 quick, 500)")
    p.add_argument("--min-reps", type=int, default=20, help="timed repetitions, at least")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    shapes = grid(args.quick)
    if args.list:
        for s in shapes:
            waste = 1 - useful_flops(s) / padded_flops(s)
            print(f"{s.key}: lengths {list(s.lengths)}, padding {100 * waste:.0f}% of the FLOPs")
        return 0
    env = open_env()
    if env is None:
        return 2
    from bench import gpu

    budget = args.budget_ms or (QUICK_BUDGET_MS if args.quick else FULL_BUDGET_MS)
    timer = gpu.Timer(env, budget, min_reps=args.min_reps)
    rows: list[dict[str, Any]] = []
    for shape in shapes:
        rows += shape_rows(env, timer, shape, args.seed)
        print(f"{shape.key}: done", flush=True)
    stem = report.result_stem(dt.date.today(), env.info.get("gpu_name", "gpu"), "serving")
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {**git_info(), **env.info, "date": dt.date.today().isoformat()}
    (args.out / f"{stem}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    (args.out / f"{stem}.md").write_text(markdown_table(rows) + "\n")
    print(markdown_table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
