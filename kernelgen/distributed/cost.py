"""A first-order cost model of the context-parallel schedules (docs/distributed.md).

Compute is FLOPs over an effective rate; a transfer is its bytes over a link's bandwidth in one
direction plus a fixed latency per message. Attention FLOPs are FlashAttention's count: the
forward of q rows against k keys is ``4 B H q k d`` (two matmuls), the backward 2.5 times that
(five matmuls, the scores recomputed). Pure Python: no torch, no GPU.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Literal

__all__ = [
    "H100_BF16",
    "INFINIBAND_NDR",
    "NVLINK_H100",
    "Hardware",
    "Link",
    "Problem",
    "break_even_length",
    "schedule_costs",
]

BACKWARD_FLOPS = 2.5  # backward FLOPs per forward FLOP (5 matmuls against 2)
ACCUMULATOR_BYTES = 4  # the ring's travelling dK/dV and the all-gather's dK/dV are fp32


@dataclass(frozen=True)
class Hardware:
    """An accelerator's sustained attention throughput (FLOP/s) and memory (bytes)."""

    name: str
    flops: float
    memory: float


@dataclass(frozen=True)
class Link:
    """A link between neighbouring ranks: bandwidth (bytes/s, one direction) and the latency
    of one message (s)."""

    name: str
    bandwidth: float
    latency: float


# Assumptions (docs/distributed.md): an H100 SXM sustaining 400 TFLOP/s of bf16 attention (about
# 40% of its dense peak, near what FlashAttention 3 reaches at long sequences); NVLink 4 at
# 450 GB/s per direction (18 links x 25 GB/s) and 10 us per NCCL send; NDR InfiniBand at
# 400 Gb/s = 50 GB/s per direction per GPU (one NIC per GPU) and 20 us.
H100_BF16 = Hardware("H100 SXM, bf16", 400e12, 80e9)
NVLINK_H100 = Link("NVLink 4", 450e9, 10e-6)
INFINIBAND_NDR = Link("InfiniBand NDR 400 Gb/s", 50e9, 20e-6)

Schedule = Literal["ring", "allgather", "ulysses"]
ShardingName = Literal["contiguous", "zigzag"]


@dataclass(frozen=True)
class Problem:
    """Self-attention over ``seqlen`` tokens sharded over ``world`` ranks."""

    seqlen: int
    world: int
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    batch: int = 1
    elem_bytes: int = 2  # bf16
    causal: bool = True
    sharding: ShardingName = "zigzag"

    @property
    def local(self) -> int:
        """Tokens per rank."""
        return self.seqlen // self.world

    def attention_flops(self, rows: float, keys: float) -> float:
        """Forward FLOPs of ``rows`` queries against ``keys`` keys (all visible)."""
        return 4.0 * self.batch * self.heads * rows * keys * self.head_dim

    def kv_bytes(self, tokens: float, elem_bytes: float | None = None) -> float:
        """Bytes of K and V for ``tokens`` tokens."""
        e = self.elem_bytes if elem_bytes is None else elem_bytes
        return 2.0 * self.batch * self.kv_heads * tokens * self.head_dim * e

    def total_flops(self) -> float:
        """Forward FLOPs of the whole sequence (causal: half the score matrix)."""
        full = self.attention_flops(self.seqlen, self.seqlen)
        return full / 2 if self.causal else full


@dataclass(frozen=True)
class Costs:
    """One schedule's modelled figures per rank, forward and backward (seconds, bytes)."""

    schedule: str
    step_compute: tuple[float, float]  # a ring step's kernels (ring only; else the whole call)
    step_transfer: tuple[float, float]  # a ring step's transfer (else the whole communication)
    time: tuple[float, float]  # the call, communication not hidden counted in
    memory: tuple[float, float]  # bytes a rank holds beyond its own shards of q, k, v, out

    @property
    def hidden(self) -> tuple[bool, bool]:
        """Whether the communication hides under the compute (ring: per step)."""
        if self.schedule != "ring":
            return (False, False)
        return tuple(c >= t for c, t in zip(self.step_compute, self.step_transfer, strict=True))


def _step_rows_keys(problem: Problem) -> tuple[float, float]:
    """(rows, keys) of the busiest rank's ring step past the first, all visible."""
    local = problem.local
    if problem.causal and problem.sharding == "zigzag":
        return local / 2, local  # half the queries against both chunks, or both against one
    return local, local  # contiguous: the last rank takes a full block every step


def schedule_costs(problem: Problem, hw: Hardware, link: Link, schedule: Schedule) -> Costs:
    """The modelled per-rank figures of ``schedule`` for ``problem``."""
    w, local = problem.world, problem.local
    if schedule == "ring":
        rows, keys = _step_rows_keys(problem)
        flops = problem.attention_flops(rows, keys)
        compute = (flops / hw.flops, BACKWARD_FLOPS * flops / hw.flops)
        kv = problem.kv_bytes(local)
        grads = problem.kv_bytes(local, ACCUMULATOR_BYTES)
        transfer = (
            kv / link.bandwidth + link.latency,
            (kv + grads) / link.bandwidth + 2 * link.latency,
        )
        steps = tuple(
            (w - 1) * max(c, t) + c for c, t in zip(compute, transfer, strict=True)
        )  # the first step is the diagonal (about half a block, counted whole)
        memory = (2 * kv, 2 * kv + 2 * grads)
        return Costs(schedule, compute, transfer, steps, memory)
    busiest = problem.total_flops() / w
    if problem.causal and problem.sharding == "contiguous":  # the last rank's share
        busiest = problem.attention_flops(local, problem.seqlen - local / 2)
    compute = (busiest / hw.flops, BACKWARD_FLOPS * busiest / hw.flops)
    if schedule == "allgather":
        gathered = problem.kv_bytes(problem.seqlen * (w - 1) / w)
        grads = problem.kv_bytes(problem.seqlen * (w - 1) / w, ACCUMULATOR_BYTES)
        comm = (
            gathered / link.bandwidth + (w - 1) * link.latency,
            (gathered + grads) / link.bandwidth + 2 * (w - 1) * link.latency,
        )
        whole = problem.kv_bytes(problem.seqlen)
        memory = (whole, whole + problem.kv_bytes(problem.seqlen, ACCUMULATOR_BYTES))
    elif schedule == "ulysses":
        kv_heads = math.lcm(problem.kv_heads, w)  # repeated up to a multiple of the world
        per_token = problem.batch * problem.head_dim * problem.elem_bytes
        moved = (w - 1) / w * local * per_token
        forward = moved * (2 * problem.heads + 2 * kv_heads)  # q, k, v in; out back
        backward = moved * (2 * problem.heads + 2 * kv_heads) * 2  # dout in; dq, dk, dv back
        comm = (forward / link.bandwidth + 4 * (w - 1) * link.latency,
                backward / link.bandwidth + 4 * (w - 1) * link.latency)  # fmt: skip
        sequence = problem.batch * problem.seqlen * problem.head_dim / w  # one head, 1/W
        copies = sequence * problem.elem_bytes * (2 * problem.heads + 2 * kv_heads)  # q k v out
        grads = sequence * (problem.heads * problem.elem_bytes  # dout
                            + ACCUMULATOR_BYTES * (problem.heads + 2 * kv_heads))  # fmt: skip
        memory = (copies, copies + grads)  # head-sharded copies, saved for backward
    else:
        raise ValueError(f"schedule={schedule!r}: expected ring, allgather or ulysses")
    time = tuple(c + t for c, t in zip(compute, comm, strict=True))
    return Costs(schedule, compute, comm, time, memory)


def break_even_length(problem: Problem, hw: Hardware, link: Link, backward: bool = False) -> float:
    """Tokens per rank from which a ring step's compute covers its K/V transfer: the root of
    ``a L^2 = b L + latency`` (``problem.seqlen`` and ``world`` do not matter)."""
    unit = replace(problem, seqlen=problem.world)  # local = 1
    rows, keys = _step_rows_keys(unit)
    a = unit.attention_flops(rows, keys) / hw.flops
    b = unit.kv_bytes(1) / link.bandwidth
    latency = link.latency
    if backward:
        a *= BACKWARD_FLOPS
        b += unit.kv_bytes(1, ACCUMULATOR_BYTES) / link.bandwidth
        latency *= 2
    return (b + math.sqrt(b * b + 4 * a * latency)) / (2 * a)
