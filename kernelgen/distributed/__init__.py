"""Context-parallel attention over torch.distributed (docs/distributed.md).

A sequence too long for one device is sharded over a process group: each rank holds a run of
positions (or two, zigzag) of q, k and v, and :func:`context_parallel_attention` gives each rank
the attention of its queries over the whole sequence, differentiable, by one of three
schedules: ``"ring"`` (K/V blocks passed around the ring), ``"allgather"`` (K/V gathered whole)
and ``"ulysses"`` (all-to-all over heads). Every block is a ``kernelgen.attention`` call (its
backward ``kernelgen.attention_backward``) on torch tensors: CUDA ones with NCCL, or CPU ones
with gloo, run by the emulator. torch is required (this package is not imported by
``kernelgen`` itself).
"""

from kernelgen.distributed.allgather import AllGatherAttention
from kernelgen.distributed.attention import SCHEDULES, context_parallel_attention
from kernelgen.distributed.blocks import BlockCall, Visibility, plan_blocks, plan_pair
from kernelgen.distributed.comm import gather_sequence
from kernelgen.distributed.ring import RingAttention
from kernelgen.distributed.sharding import Segment, Sharding
from kernelgen.distributed.ulysses import UlyssesAttention

__all__ = [
    "SCHEDULES",
    "AllGatherAttention",
    "BlockCall",
    "RingAttention",
    "Segment",
    "Sharding",
    "UlyssesAttention",
    "Visibility",
    "context_parallel_attention",
    "gather_sequence",
    "plan_blocks",
    "plan_pair",
]
