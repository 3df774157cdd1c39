"""Ring attention: K/V blocks travel around the group; each rank keeps its queries.

Step s (0 .. W-1) of rank r holds the K/V of rank ``src = r - s`` (mod W). The transfer of the
next block (to r + 1, from r - 1) is started before the step's kernels and waited on after
them, so it overlaps the compute. The blocks of a step come from
:func:`kernelgen.distributed.blocks.plan_blocks` over the two ranks' runs of global positions:
with a contiguous sharding and a causal mask, rank r's steps are one diagonal block and r full
ones (rank 0 computes at step 0 only and then just passes blocks on); with the zigzag sharding
every step past the first is one call on half the queries or half the keys.

Backward: the same ring. dq stays home; the dK/dV of a visiting block are accumulated (fp32)
into a buffer that travels one step behind it: at step s, rank r adds its share for block
``src`` to the accumulator it received from r - 1 (which held the shares of src .. r - 1) and
sends it on; after W steps every accumulator is back at its owner, complete.
"""

from __future__ import annotations

import torch

from kernelgen.distributed.blocks import BlockCall, plan_blocks
from kernelgen.distributed.calls import backward_blocks, fold_sinks, forward_blocks, sink_gradient
from kernelgen.distributed.comm import GRAD_TAG, KV_TAG, wait_all
from kernelgen.distributed.schedule import Saved, Setup, autograd_function

__all__ = ["RingAttention", "ring_calls"]


def ring_calls(setup: Setup, rank: int, step: int) -> list[BlockCall]:
    """Rank ``rank``'s block calls at ring step ``step`` (K/V of rank ``rank - step``)."""
    sharding = setup.sharding
    src = (rank - step) % sharding.world
    return plan_blocks(
        sharding.segments(rank), sharding.segments(src), setup.rule, setup.options.positional
    )


def _kv_buffers(setup: Setup, like: torch.Tensor, step: int, dtype: torch.dtype) -> tuple:
    """Empty (B, Hkv, L, D) buffers for the K/V (or their gradients) of step ``step``'s block."""
    length = setup.sharding.length((setup.rank - step) % setup.world)
    shape = (*like.shape[:2], length, like.shape[3])
    return tuple(like.new_empty(shape, dtype=dtype) for _ in range(2))


def ring_forward(
    setup: Setup, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, Saved]:
    """The ring's forward: (out, lse, tensors saved for backward)."""
    acc_out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    acc_lse = torch.full(q.shape[:3], -torch.inf, dtype=torch.float32, device=q.device)
    kv = (k.contiguous(), v.contiguous())
    for step in range(setup.world):
        requests, incoming = [], kv
        if step + 1 < setup.world:
            incoming = _kv_buffers(setup, k, step + 1, k.dtype)
            requests = setup.group.ring_step(kv, incoming, KV_TAG)
        forward_blocks(ring_calls(setup, setup.rank, step), q, *kv, setup.options, acc_out, acc_lse)
        wait_all(requests)
        kv = incoming
    if setup.options.sinks is not None:
        fold_sinks(acc_out, acc_lse, setup.options.sinks)
    out = acc_out.to(q.dtype)
    return out, acc_lse, (q, k, v, out, acc_lse)


def ring_backward(setup: Setup, dout: torch.Tensor, saved: Saved) -> tuple:
    """The ring's backward: (dq, dk, dv, dsinks or None), fp32."""
    q, k, v, out, lse = saved
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    kv = (k.contiguous(), v.contiguous())
    grad_requests: list = []
    sending: tuple = ()  # the accumulator being sent: alive until its request is waited on
    travelling: tuple = ()
    for step in range(setup.world):
        kv_requests, incoming = [], kv
        if step + 1 < setup.world:
            incoming = _kv_buffers(setup, k, step + 1, k.dtype)
            kv_requests = setup.group.ring_step(kv, incoming, KV_TAG)
        calls = ring_calls(setup, setup.rank, step)
        share: tuple = ()
        if calls or step == 0:
            share = tuple(g.zero_() for g in _kv_buffers(setup, k, step, torch.float32))
            backward_blocks(calls, dout, q, *kv, out, lse, setup.options, dq, *share)
        if step > 0:  # the shares of the ranks this block visited before
            wait_all(grad_requests)
            if share:
                for mine, theirs in zip(share, travelling, strict=True):
                    mine.add_(theirs)
            else:
                share = travelling
        if setup.world > 1:  # on to the next rank; after the last step, home
            sending, travelling = share, _kv_buffers(setup, k, step + 1, torch.float32)
            grad_requests = setup.group.ring_step(sending, travelling, GRAD_TAG)
        else:
            travelling = share
        wait_all(kv_requests)
        kv = incoming
    wait_all(grad_requests)
    dk, dv = travelling
    dsinks = None
    if setup.options.sinks is not None:
        dsinks = sink_gradient(dout, out, lse, setup.options.sinks)
    return dq, dk, dv, dsinks


RingAttention = autograd_function("RingAttention", ring_forward, ring_backward)
