"""All-gather attention (the llama3 form): every rank gathers the whole K/V, in global order,
and runs its own queries against it.

One run of queries ``[qs, qe)`` against all keys is cut by the causal rule to keys
``[0, qe)`` (or by a window to its reach), whose last key is the last query's position: the
call's bottom-right causal alignment is then exactly the global one, so a contiguous shard is
one causal call and a zigzag shard two. The two gathers (K and V) are started together; the
gathered K/V is not kept for backward (memory): the backward gathers it again, accumulates
dK/dV for the whole sequence (fp32) and reduce-scatters them to their owners.
"""

from __future__ import annotations

import torch

from kernelgen.distributed.blocks import BlockCall, plan_blocks
from kernelgen.distributed.calls import backward_blocks, fold_sinks, forward_blocks, sink_gradient
from kernelgen.distributed.comm import all_gather_padded, reduce_scatter_padded, wait_all
from kernelgen.distributed.schedule import Saved, Setup, autograd_function
from kernelgen.distributed.sharding import Segment

__all__ = ["AllGatherAttention", "allgather_calls"]


def allgather_calls(setup: Setup, rank: int) -> list[BlockCall]:
    """Rank ``rank``'s block calls against the gathered sequence."""
    everything = [Segment(0, setup.sharding.total, 0)]
    return plan_blocks(
        setup.sharding.segments(rank), everything, setup.rule, setup.options.positional
    )


def _gather(setup: Setup, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole K and V, (B, Hkv, S, D) in global order."""
    lengths = [setup.sharding.length(r) for r in range(setup.world)]
    k_parts, k_request = all_gather_padded(setup.group, k, lengths, async_op=True)
    v_parts, v_request = all_gather_padded(setup.group, v, lengths, async_op=True)
    wait_all([k_request, v_request])
    return setup.sharding.unshard(k_parts), setup.sharding.unshard(v_parts)


def allgather_forward(
    setup: Setup, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, Saved]:
    """All-gather forward: (out, lse, tensors saved for backward)."""
    keys, values = _gather(setup, k, v)
    acc_out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    acc_lse = torch.full(q.shape[:3], -torch.inf, dtype=torch.float32, device=q.device)
    forward_blocks(allgather_calls(setup, setup.rank), q, keys, values, setup.options, acc_out,
                   acc_lse)  # fmt: skip
    if setup.options.sinks is not None:
        fold_sinks(acc_out, acc_lse, setup.options.sinks)
    out = acc_out.to(q.dtype)
    return out, acc_lse, (q, k, v, out, acc_lse)


def allgather_backward(setup: Setup, dout: torch.Tensor, saved: Saved) -> tuple:
    """All-gather backward: (dq, dk, dv, dsinks or None), fp32."""
    q, k, v, out, lse = saved
    keys, values = _gather(setup, k, v)
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dkeys, dvalues = (torch.zeros(keys.shape, dtype=torch.float32, device=q.device) for _ in "kv")
    calls = allgather_calls(setup, setup.rank)
    backward_blocks(calls, dout, q, keys, values, out, lse, setup.options, dq, dkeys, dvalues)
    lengths = [setup.sharding.length(r) for r in range(setup.world)]
    dk, dv = (
        reduce_scatter_padded(
            setup.group, [setup.sharding.shard(g, r) for r in range(setup.world)], lengths
        )
        for g in (dkeys, dvalues)
    )
    dsinks = None
    if setup.options.sinks is not None:
        dsinks = sink_gradient(dout, out, lse, setup.options.sinks)
    return dq, dk, dv, dsinks


AllGatherAttention = autograd_function("AllGatherAttention", allgather_forward, allgather_backward)
