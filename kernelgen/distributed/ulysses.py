"""Ulysses attention: an all-to-all turns sequence shards of every head into the whole sequence
of H / W heads per rank, one ordinary attention call runs there, and another all-to-all brings
the output back to sequence shards.

The heads must divide evenly: H % W == 0. K/V heads that do not (Hkv % W != 0) are repeated
first, each ``lcm(Hkv, W) / Hkv`` times (repeat_interleave keeps query head h on the copy of its
own K/V head), and their gradients summed back. The local call sees the whole sequence in
global order, so every position-dependent variant is exact (the diagonal is the global one).
Backward saves the head-sharded q, k, v, out and lse, sends dout the same way, and returns dq,
dk and dv by the reverse all-to-all. dsinks: this rank's heads, over the whole sequence.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch

from kernelgen.distributed.blocks import BlockCall, plan_blocks
from kernelgen.distributed.calls import backward_blocks, fold_sinks, forward_blocks, sink_gradient
from kernelgen.distributed.comm import all_to_all
from kernelgen.distributed.schedule import Saved, Setup, autograd_function
from kernelgen.distributed.sharding import Segment

__all__ = ["UlyssesAttention", "kv_repeats", "ulysses_calls"]


def kv_repeats(kv_heads: int, world: int) -> int:
    """How many copies of each K/V head make their number a multiple of ``world``."""
    return math.lcm(kv_heads, world) // kv_heads


def ulysses_calls(setup: Setup) -> list[BlockCall]:
    """The one call (or none) of the whole sequence against itself."""
    everything = [Segment(0, setup.sharding.total, 0)]
    return plan_blocks(everything, everything, setup.rule, setup.options.positional)


def _to_heads(setup: Setup, x: torch.Tensor) -> torch.Tensor:
    """(B, H, L_r, D) sequence shards -> (B, H / W, S, D): this rank's heads, whole sequence."""
    world, sharding = setup.world, setup.sharding
    per = x.shape[1] // world
    send = [x[:, p * per : (p + 1) * per].contiguous() for p in range(world)]
    shapes = [(x.shape[0], per, sharding.length(p), x.shape[3]) for p in range(world)]
    return sharding.unshard(all_to_all(setup.group, send, shapes))


def _to_sequence(setup: Setup, x: torch.Tensor) -> torch.Tensor:
    """(B, H / W, S, D) -> (B, H, L_r, D): the inverse of :func:`_to_heads`."""
    world, sharding = setup.world, setup.sharding
    send = [sharding.shard(x, p).contiguous() for p in range(world)]
    shape = (x.shape[0], x.shape[1], sharding.length(setup.rank), x.shape[3])
    return torch.cat(all_to_all(setup.group, send, [shape] * world), dim=1)


def _local_setup(setup: Setup, heads: int) -> Setup:
    """``setup`` with the options of this rank's ``heads`` query heads (ALiBi slopes, sinks,
    the first head's index for expressions)."""
    h0, h1 = setup.rank * heads, (setup.rank + 1) * heads
    options = setup.options
    return replace(
        setup,
        options=replace(
            options,
            alibi=None if options.alibi is None else options.alibi[:, h0:h1],
            sinks=None if options.sinks is None else options.sinks[h0:h1],
            head_offset=h0,
        ),
    )


def ulysses_forward(
    setup: Setup, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, Saved]:
    """Ulysses forward: (out, lse, tensors saved for backward)."""
    repeats = kv_repeats(k.shape[1], setup.world)
    if repeats > 1:
        k, v = (x.repeat_interleave(repeats, dim=1) for x in (k, v))
    heads = q.shape[1] // setup.world
    local = _local_setup(setup, heads)
    qh, kh, vh = (_to_heads(setup, x) for x in (q, k, v))
    acc_out = torch.zeros(qh.shape, dtype=torch.float32, device=q.device)
    acc_lse = torch.full(qh.shape[:3], -torch.inf, dtype=torch.float32, device=q.device)
    forward_blocks(ulysses_calls(local), qh, kh, vh, local.options, acc_out, acc_lse)
    if local.options.sinks is not None:
        fold_sinks(acc_out, acc_lse, local.options.sinks)
    out_h = acc_out.to(q.dtype)
    out = _to_sequence(setup, out_h)
    lse = _to_sequence(setup, acc_lse.unsqueeze(-1)).squeeze(-1)
    return out, lse, (qh, kh, vh, out_h, acc_lse)


def ulysses_backward(setup: Setup, dout: torch.Tensor, saved: Saved) -> tuple:
    """Ulysses backward: (dq, dk, dv, dsinks or None), fp32."""
    qh, kh, vh, out_h, lse_h = saved
    heads = qh.shape[1]
    local = _local_setup(setup, heads)
    dout_h = _to_heads(setup, dout)
    grads = [torch.zeros(x.shape, dtype=torch.float32, device=x.device) for x in (qh, kh, vh)]
    backward_blocks(ulysses_calls(local), dout_h, qh, kh, vh, out_h, lse_h, local.options, *grads)
    dq, dk, dv = (_to_sequence(setup, g) for g in grads)
    repeats = kv_repeats(setup.kv_heads, setup.world)
    if repeats > 1:  # the copies' gradients, summed into their K/V head
        dk, dv = (g.unflatten(1, (setup.kv_heads, repeats)).sum(2) for g in (dk, dv))
    dsinks = None
    if local.options.sinks is not None:
        dsinks = torch.zeros(heads * setup.world, dtype=torch.float32, device=qh.device)
        h0 = setup.rank * heads
        dsinks[h0 : h0 + heads] = sink_gradient(dout_h, out_h, lse_h, local.options.sinks)
    return dq, dk, dv, dsinks


UlyssesAttention = autograd_function("UlyssesAttention", ulysses_forward, ulysses_backward)
