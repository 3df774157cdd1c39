"""Context-parallel attention over torch.distributed (docs/distributed.md).

A sequence too long for one device is sharded over a process group: each rank holds a run of
positions (or two, zigzag) of q, k and v, and :func:`context_parallel_attention` gives each rank
the attention of its queries over the whole sequence, differentiable, by one of three
schedules: ``"ring"`` (K/V blocks passed around the ring), ``"allgather"`` (K/V gathered whole)
and ``"ulysses"`` (all-to-all over heads). Every block is a ``kernelgen.attention`` call (its
backward ``kernelgen.attention_backward``) on torch tensors: CUDA ones with NCCL, or CPU ones
with gloo, run by the emulator.

torch is needed by the schedules only: the shardings (:mod:`.sharding`), the block planner
(:mod:`.blocks`) and the cost model (:mod:`.cost`) are pure Python, and this package imports
the torch-side names on first use. ``kernelgen`` itself does not import this package.
"""

from __future__ import annotations

from typing import Any

from kernelgen.distributed.blocks import BlockCall, Visibility, plan_blocks, plan_pair
from kernelgen.distributed.sharding import Segment, Sharding

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


def __getattr__(name: str) -> Any:
    """The torch-side names, imported on first use."""
    if name in ("SCHEDULES", "context_parallel_attention"):
        from kernelgen.distributed import attention as module
    elif name == "RingAttention":
        from kernelgen.distributed import ring as module
    elif name == "AllGatherAttention":
        from kernelgen.distributed import allgather as module
    elif name == "UlyssesAttention":
        from kernelgen.distributed import ulysses as module
    elif name == "gather_sequence":
        from kernelgen.distributed import comm as module
    else:
        raise AttributeError(f"module 'kernelgen.distributed' has no attribute {name!r}")
    return getattr(module, name)
