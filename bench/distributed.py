"""``torchrun --nproc-per-node 8 -m bench.distributed``: context-parallel attention, each schedule
timed on a multi-GPU machine (NCCL).

Every rank makes its shard of random q, k, v ((B, H, S / W, D), bf16 by default) and, for each
sequence length and schedule (``kernelgen.distributed.context_parallel_attention``), warms up
and then times the forward and the forward + backward with CUDA events: the median over
``--repeats`` of the slowest rank (every step waits for it). Next to each figure, the cost
model's (:mod:`kernelgen.distributed.cost`, the link of ``--link``), and each schedule's output
against the first schedule's (relative Frobenius error: they must agree). Rank 0 prints a table
and writes ``<out>/<date>-distributed-w<W>.json``.

``--dry-run`` needs no GPU and no process group: for ``--world`` ranks it prints each schedule's
block calls (the planner's, per ring step) with the busiest rank's share of the work, the
modelled times and whether the ring hides its transfers, and the break-even lengths.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.harness import ROOT, git_info, positive_int
from kernelgen.distributed.blocks import Visibility, plan_blocks, visible_pairs
from kernelgen.distributed.cost import (
    H100_BF16,
    INFINIBAND_NDR,
    NVLINK_H100,
    Problem,
    break_even_length,
    schedule_costs,
)
from kernelgen.distributed.sharding import Segment, Sharding

SCHEDULES = ("ring", "allgather", "ulysses")
LINKS = {"nvlink": NVLINK_H100, "ib": INFINIBAND_NDR}
DTYPES = {"bf16": "bfloat16", "fp16": "float16"}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="torchrun --nproc-per-node W -m bench.distributed",
        description="Time kernelgen's context-parallel attention schedules (ring, allgather, "
        "ulysses) over NCCL, next to the cost model's figures.",
    )
    p.add_argument("--schedule", action="append", choices=SCHEDULES, help="repeatable (all)")
    p.add_argument(
        "--seqlen",
        action="append",
        type=positive_int,
        metavar="S",
        help="total tokens over the group, repeatable (131072)",
    )
    p.add_argument("--sharding", choices=("contiguous", "zigzag"), default="zigzag")
    p.add_argument("--heads", type=positive_int, default=32)
    p.add_argument("--kv-heads", type=positive_int, default=8)
    p.add_argument("--head-dim", type=positive_int, default=128)
    p.add_argument("--batch", type=positive_int, default=1)
    p.add_argument("--dtype", choices=tuple(DTYPES), default="bf16")
    p.add_argument("--causal", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument(
        "--backward", action=argparse.BooleanOptionalAction, default=True, help="also time fwd+bwd"
    )
    p.add_argument("--warmup", type=positive_int, default=3)
    p.add_argument("--repeats", type=positive_int, default=10)
    p.add_argument("--link", choices=tuple(LINKS), default="nvlink", help="for the model")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    p.add_argument("--dry-run", action="store_true", help="plan and model only (no GPU)")
    p.add_argument(
        "--cpu",
        action="store_true",
        help="gloo and CPU tensors through the emulator: tiny shapes only, to check the script",
    )
    p.add_argument(
        "--world", type=positive_int, default=8, help="ranks of --dry-run (a run: torchrun's)"
    )
    args = p.parse_args(argv)
    args.schedule = args.schedule or list(SCHEDULES)
    args.seqlen = args.seqlen or [131072]
    if args.heads % args.kv_heads:
        p.error(f"--heads {args.heads} must be a multiple of --kv-heads {args.kv_heads}")
    return args


def make_sharding(args: argparse.Namespace, seqlen: int, world: int) -> Sharding:
    if args.sharding == "zigzag":
        return Sharding.zigzag(seqlen, world)
    return Sharding.contiguous(seqlen, world)


def problem_of(args: argparse.Namespace, seqlen: int, world: int) -> Problem:
    return Problem(
        seqlen=seqlen,
        world=world,
        heads=args.heads,
        kv_heads=args.kv_heads,
        head_dim=args.head_dim,
        batch=args.batch,
        causal=args.causal,
        sharding=args.sharding,
    )


def plan(args: argparse.Namespace, schedule: str, seqlen: int, world: int) -> dict[str, Any]:
    """The planner's calls of ``schedule``: per rank (and ring step) the number of calls and
    visible (query, key) pairs; the busiest rank's share against an even split."""
    sharding = make_sharding(args, seqlen, world)
    rule = Visibility.of(args.causal, None)
    everything = [Segment(0, seqlen, 0)]
    steps: list[list[tuple[int, int]]] = []  # per rank: (calls, pairs) per step
    for rank in range(world):
        if schedule == "ring":
            mine = sharding.segments(rank)
            blocks = [
                plan_blocks(mine, sharding.segments((rank - s) % world), rule, False)
                for s in range(world)
            ]
        elif schedule == "allgather":
            blocks = [plan_blocks(sharding.segments(rank), everything, rule, False)]
        else:  # ulysses: every rank the whole sequence, H / W heads
            blocks = [plan_blocks(everything, everything, rule, False)]
        steps.append([(len(b), sum(visible_pairs(c) for c in b)) for b in blocks])
    per_rank = [sum(pairs for _, pairs in rank) for rank in steps]
    if schedule == "ulysses":
        per_rank = [p // world for p in per_rank]  # a 1/W share of the heads
    total = sum(per_rank)
    return {
        "schedule": schedule,
        "seqlen": seqlen,
        "world": world,
        "calls_per_step": [[c for c, _ in rank] for rank in steps],
        "pairs_per_rank": per_rank,
        "imbalance": max(per_rank) * world / total if total else 1.0,
    }


def model(args: argparse.Namespace, schedule: str, seqlen: int, world: int) -> dict[str, Any]:
    """The cost model's figures for one schedule (milliseconds, GB)."""
    costs = schedule_costs(problem_of(args, seqlen, world), H100_BF16, LINKS[args.link], schedule)
    return {
        "model_forward_ms": costs.time[0] * 1e3,
        "model_backward_ms": costs.time[1] * 1e3,
        "model_step_compute_ms": [c * 1e3 for c in costs.step_compute],
        "model_step_transfer_ms": [t * 1e3 for t in costs.step_transfer],
        "model_hidden": list(costs.hidden),
        "model_extra_memory_gb": [m / 1e9 for m in costs.memory],
    }


def dry_run(args: argparse.Namespace, out: Any = None) -> int:
    """Print the plan and the model for ``--world`` ranks (to ``out``, stdout by default);
    nothing is launched."""
    out = out or sys.stdout
    world = args.world
    link = LINKS[args.link]
    print(f"dry run: {world} ranks, {args.sharding} sharding, causal={args.causal}, "
          f"H={args.heads} Hkv={args.kv_heads} d={args.head_dim} B={args.batch} {args.dtype}, "
          f"model: {H100_BF16.name} at {H100_BF16.flops / 1e12:.0f} TFLOP/s, {link.name}",
          file=out)  # fmt: skip
    unit = problem_of(args, world, world)
    for backward in (False, True):
        length = break_even_length(unit, H100_BF16, link, backward=backward)
        which = "fwd+bwd" if backward else "fwd"
        print(f"ring break-even ({which}): {length:,.0f} tokens per rank", file=out)
    print(f"{'schedule':<10} {'seqlen':>9} {'calls/step (rank 0..)':<28} {'imbalance':>9} "
          f"{'fwd ms':>9} {'bwd ms':>9} {'hidden':>7} {'extra GB':>9}", file=out)  # fmt: skip
    for seqlen in args.seqlen:
        for schedule in args.schedule:
            if schedule == "ulysses" and args.heads % world:
                print(f"{schedule:<10} {seqlen:>9} heads {args.heads} % {world} ranks != 0",
                      file=out)  # fmt: skip
                continue
            p, m = plan(args, schedule, seqlen, world), model(args, schedule, seqlen, world)
            calls = ";".join("".join(str(min(c, 9)) for c in r) for r in p["calls_per_step"])
            hidden = "/".join("y" if h else "n" for h in m["model_hidden"])
            print(f"{schedule:<10} {seqlen:>9} {calls[:28]:<28} {p['imbalance']:>9.2f} "
                  f"{m['model_forward_ms']:>9.2f} {m['model_backward_ms']:>9.2f} {hidden:>7} "
                  f"{m['model_extra_memory_gb'][1]:>9.2f}", file=out)  # fmt: skip
    return 0


def run(args: argparse.Namespace) -> int:
    """Time every (seqlen, schedule) on the torchrun group: NCCL with one GPU per rank, or with
    ``--cpu`` gloo and the emulator (wall-clock times, meaningless but for the plumbing)."""
    import torch
    import torch.distributed as dist

    from kernelgen.distributed import context_parallel_attention

    if args.cpu:
        device = "cpu"
    elif torch.cuda.is_available():
        device = "cuda"
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    else:
        print("bench.distributed: no CUDA device (--dry-run or --cpu on a CPU)", file=sys.stderr)
        return 2
    backend = "gloo" if device == "cpu" else "nccl"
    dist.init_process_group(backend, timeout=dt.timedelta(minutes=10))
    rank, world = dist.get_rank(), dist.get_world_size()
    dtype = torch.float32 if device == "cpu" else getattr(torch, DTYPES[args.dtype])
    rows = []
    for seqlen in args.seqlen:
        sharding = make_sharding(args, seqlen, world)
        gen = torch.Generator(device=device).manual_seed(1234 + rank)
        shape = (args.batch, args.heads, sharding.length(rank), args.head_dim)
        kv_shape = (*shape[:1], args.kv_heads, *shape[2:])
        q, dout = (torch.randn(shape, device=device, generator=gen).to(dtype) for _ in "qo")
        k, v = (torch.randn(kv_shape, device=device, generator=gen).to(dtype) for _ in "kv")
        first_out = None
        for schedule in args.schedule:
            if schedule == "ulysses" and args.heads % world:
                continue
            leaves = [x.detach().requires_grad_(args.backward) for x in (q, k, v)]

            def call(schedule: str = schedule, leaves: list = leaves, cut: Any = sharding) -> Any:
                return context_parallel_attention(
                    *leaves, schedule=schedule, sharding=cut, causal=args.causal
                )

            forward = _time(call, args, dist, device, backward=None)
            both = _time(call, args, dist, device, backward=dout) if args.backward else None
            out = call().detach().float()
            if first_out is None:
                first_out, agreement = out, 0.0
            else:
                agreement = float((out - first_out).norm() / first_out.norm())
            row = {"schedule": schedule, "seqlen": seqlen, "world": world, "forward_ms": forward,
                   "forward_backward_ms": both, "rel_error_vs_first": agreement,
                   **model(args, schedule, seqlen, world)}  # fmt: skip
            rows.append(row)
            if rank == 0:
                print(_row_line(row), flush=True)
    if rank == 0:
        args.out.mkdir(parents=True, exist_ok=True)
        path = args.out / f"{dt.date.today()}-distributed-w{world}.json"
        name = "cpu (gloo, emulator)" if device == "cpu" else torch.cuda.get_device_name()
        meta = {"args": {k: str(v) for k, v in vars(args).items()}, **git_info(), "device": name}
        path.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
        print(f"wrote {path}")
    dist.destroy_process_group()
    return 0


def _row_line(row: dict[str, Any]) -> str:
    """One measured row, with the model's figures beside it."""
    both = row["forward_backward_ms"]
    both_text = "-" if both is None else f"{both:.3f}"
    return (
        f"{row['schedule']:<10} S={row['seqlen']:<9} fwd {row['forward_ms']:9.3f} ms (model "
        f"{row['model_forward_ms']:.3f})  fwd+bwd {both_text} ms (model "
        f"{row['model_forward_ms'] + row['model_backward_ms']:.3f})  vs first "
        f"{row['rel_error_vs_first']:.1e}"
    )


def _time(call: Any, args: argparse.Namespace, dist: Any, device: str, backward: Any) -> float:
    """Median over repeats of the slowest rank's milliseconds for ``call`` (and its backward
    with ``backward`` as dout): CUDA events on a GPU, the wall clock on the CPU."""
    import time

    import torch

    def once() -> None:
        out = call()
        if backward is not None:
            out.backward(backward)

    for _ in range(args.warmup):
        once()
    times = []
    for _ in range(args.repeats):
        dist.barrier()
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            once()
            end.record()
            torch.cuda.synchronize()
            elapsed = start.elapsed_time(end)
        else:
            began = time.perf_counter()
            once()
            elapsed = (time.perf_counter() - began) * 1e3
        slowest = torch.tensor([elapsed], device=device)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        times.append(float(slowest))
    return statistics.median(times)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.dry_run:
        return dry_run(args)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
