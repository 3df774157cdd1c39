"""What every schedule shares: the call's :class:`Setup` and the autograd Function each schedule
is made into (:func:`autograd_function`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from kernelgen.distributed.blocks import Visibility
from kernelgen.distributed.calls import Options
from kernelgen.distributed.comm import Group
from kernelgen.distributed.sharding import Sharding

__all__ = ["Setup", "autograd_function"]

Saved = tuple[torch.Tensor, ...]
Forward = Callable[["Setup", torch.Tensor, torch.Tensor, torch.Tensor], tuple[Any, Any, Saved]]
Backward = Callable[["Setup", torch.Tensor, Saved], tuple[Any, Any, Any, Any]]


@dataclass(frozen=True, eq=False)
class Setup:
    """One call's group, sharding, global visibility rule, block options and K/V heads."""

    group: Group
    sharding: Sharding
    rule: Visibility
    options: Options
    kv_heads: int

    @property
    def rank(self) -> int:
        return self.group.rank

    @property
    def world(self) -> int:
        return self.group.world


def autograd_function(name: str, forward: Forward, backward: Backward) -> type:
    """A ``torch.autograd.Function`` named ``name``: ``apply(setup, q, k, v, sinks)`` gives
    ``(out, lse)`` from ``forward(setup, q, k, v) -> (out, lse, saved)`` (lse carries no
    gradient); its backward is ``backward(setup, dout, saved) -> (dq, dk, dv, dsinks)``, cast
    to the inputs' dtypes (dsinks only when sinks require it)."""

    def fwd(ctx: Any, setup: Setup, q: Any, k: Any, v: Any, sinks: Any) -> tuple[Any, Any]:
        out, lse, saved = forward(setup, q, k, v)
        ctx.setup = setup
        ctx.dtypes = (q.dtype, k.dtype, v.dtype)
        ctx.save_for_backward(*saved)
        ctx.mark_non_differentiable(lse)
        return out, lse

    def bwd(ctx: Any, dout: Any, _dlse: Any) -> tuple[Any, ...]:
        dq, dk, dv, dsinks = backward(ctx.setup, dout.contiguous(), ctx.saved_tensors)
        grads = tuple(g.to(t) for g, t in zip((dq, dk, dv), ctx.dtypes, strict=True))
        return (None, *grads, dsinks if ctx.needs_input_grad[4] else None)

    namespace = {
        "forward": staticmethod(fwd),
        "backward": staticmethod(bwd),
        "__doc__": f"Context-parallel attention, schedule {name!r}, as an autograd Function.",
        "__module__": forward.__module__,
        "__qualname__": name,
    }
    return type(name, (torch.autograd.Function,), namespace)
