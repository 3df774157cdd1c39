"""The collectives the schedules use, on torch.distributed (NCCL on GPUs, gloo on CPUs).

Point-to-point transfers go through ``batch_isend_irecv`` (grouped, so NCCL posts the send and
the receive of a ring step together); empty tensors are not sent (every rank knows every
shard's length from the sharding). All-gather and reduce-scatter pad ranks' shards to the
longest (uneven shardings); all-to-all uses ``all_to_all_single`` with split sizes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "GRAD_TAG",
    "KV_TAG",
    "Group",
    "all_gather_padded",
    "all_to_all",
    "gather_sequence",
    "reduce_scatter_padded",
    "wait_all",
]

KV_TAG = 1  # the ring's K/V blocks
GRAD_TAG = 2  # the ring's travelling dK/dV accumulators


@dataclass(frozen=True)
class Group:
    """A process group (None: the default group) with this process's rank and the world size."""

    handle: Any
    rank: int
    world: int

    @classmethod
    def of(cls, group: Any = None) -> Group:
        if not dist.is_available() or not dist.is_initialized():
            from kernelgen.errors import InputError

            raise InputError(
                "context-parallel attention needs torch.distributed initialized "
                "(torch.distributed.init_process_group) before the call"
            )
        return cls(group, dist.get_rank(group), dist.get_world_size(group))

    def global_rank(self, rank: int) -> int:
        """The default group's rank of this group's ``rank`` (what P2P calls take)."""
        if self.handle is None:
            return rank
        return dist.get_global_rank(self.handle, rank)

    @property
    def next(self) -> int:
        return (self.rank + 1) % self.world

    @property
    def prev(self) -> int:
        return (self.rank - 1) % self.world

    def ring_step(
        self, send: Sequence[torch.Tensor], recv: Sequence[torch.Tensor], tag: int
    ) -> list[Any]:
        """Start sending ``send`` to the next rank and receiving ``recv`` from the previous one;
        returns the requests (wait on each before touching the buffers)."""
        ops = [
            dist.P2POp(dist.isend, t, self.global_rank(self.next), self.handle, tag)
            for t in send
            if t.numel()
        ]
        ops += [
            dist.P2POp(dist.irecv, t, self.global_rank(self.prev), self.handle, tag)
            for t in recv
            if t.numel()
        ]
        return dist.batch_isend_irecv(ops) if ops else []


def wait_all(requests: Sequence[Any]) -> None:
    for request in requests:
        request.wait()


def _padded(x: torch.Tensor, length: int) -> torch.Tensor:
    """``x`` (B, H, L, D) padded with zeros to ``length`` rows, contiguous."""
    if x.shape[2] == length:
        return x.contiguous()
    pad = x.new_zeros((*x.shape[:2], length - x.shape[2], *x.shape[3:]))
    return torch.cat([x, pad], dim=2)


def all_gather_padded(
    group: Group, x: torch.Tensor, lengths: Sequence[int], async_op: bool = False
) -> tuple[list[torch.Tensor], Any]:
    """Every rank's (B, H, lengths[r], D) shard (the list is filled once the request returned
    with ``async_op`` is waited on; None without)."""
    longest = max(lengths)
    pieces = [x.new_empty((*x.shape[:2], longest, *x.shape[3:])) for _ in lengths]
    request = dist.all_gather(pieces, _padded(x, longest), group=group.handle, async_op=async_op)
    return [p.narrow(2, 0, n) for p, n in zip(pieces, lengths, strict=True)], request


def reduce_scatter_padded(
    group: Group, pieces: Sequence[torch.Tensor], lengths: Sequence[int]
) -> torch.Tensor:
    """Sum over ranks of ``pieces[r]`` (B, H, lengths[r], D) arriving at rank r."""
    longest = max(lengths)
    inputs = [_padded(p, longest) for p in pieces]
    result = inputs[0].new_empty(inputs[0].shape)
    dist.reduce_scatter(result, inputs, group=group.handle)
    return result.narrow(2, 0, lengths[group.rank])


def all_to_all(
    group: Group, send: Sequence[torch.Tensor], recv_shapes: Sequence[tuple[int, ...]]
) -> list[torch.Tensor]:
    """Send ``send[r]`` to rank r and receive one tensor of ``recv_shapes[r]`` from each rank r
    (one ``all_to_all_single`` over flattened buffers)."""
    flat_in = torch.cat([t.reshape(-1) for t in send])
    sizes_out = [int(torch.Size(s).numel()) for s in recv_shapes]
    flat_out = flat_in.new_empty(sum(sizes_out))
    dist.all_to_all_single(
        flat_out,
        flat_in,
        output_split_sizes=sizes_out,
        input_split_sizes=[t.numel() for t in send],
        group=group.handle,
    )
    return [
        part.view(shape) for part, shape in zip(flat_out.split(sizes_out), recv_shapes, strict=True)
    ]


def gather_sequence(
    x: torch.Tensor, sharding: Any, group: Any = None, dim: int = 2
) -> torch.Tensor:
    """The whole sequence on every rank, from each rank's shard ``x`` (sequence along ``dim``)
    and the :class:`~kernelgen.distributed.sharding.Sharding` they were cut with (no gradient)."""
    info = Group.of(group)
    moved = x.detach().movedim(dim, 2)
    lengths = [sharding.length(r) for r in range(info.world)]
    pieces, _ = all_gather_padded(info, moved, lengths)
    return sharding.unshard(pieces).movedim(2, dim)
