"""The local work of every schedule: a set of :class:`~kernelgen.distributed.blocks.BlockCall`
run through ``kernelgen.attention`` (forward) and ``kernelgen.attention_backward`` (backward)
on torch tensors, and the monoid that merges the partial results.

Forward: each block gives ``(out_b, lse_b)`` over its rows, folded into fp32 accumulators as
the attention monoid on (out, lse) (docs/design.md, "One update, many orders"):
``lse = logaddexp(lse, lse_b)``, ``out = e^(lse_old - lse) out + e^(lse_b - lse) out_b``, a row
no block reached keeps ``(0, -inf)``. Sinks join once, at the end, as the state
``(0, sink_h)``.

Backward: every block is differentiated against the GLOBAL out and lse (sinks included), so its
``P = exp(S - lse)`` are the true probabilities and its dq, dk, dv are exact shares of the
gradients: they are summed (fp32) wherever they belong. ``dsinks`` is
``-sum_rows exp(sink_h - lse) (dout . out)`` over the rank's rows (its share).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from kernelgen.calls.attention import attention
from kernelgen.calls.backward import attention_backward
from kernelgen.distributed.blocks import BlockCall
from kernelgen.distributed.positions import ALIBI_INPUT, POSITIONS_INPUT, with_alibi

__all__ = [
    "Options",
    "backward_blocks",
    "block_kwargs",
    "fold_sinks",
    "forward_blocks",
    "merge",
    "sink_gradient",
]


@dataclass(frozen=True, eq=False)
class Options:
    """The attention options every block call shares: ``scale`` (resolved), ``softcap``,
    ``alibi`` ((B, H) float32 view, or None), ``sinks`` ((H,) or None; never passed to a block:
    :func:`fold_sinks`), the user's expressions rewritten for global positions
    (:mod:`kernelgen.distributed.positions`) with their ``mod_inputs``, and ``head_offset``,
    the first head of the call (Ulysses)."""

    scale: float
    softcap: float | None = None
    alibi: torch.Tensor | None = None
    sinks: torch.Tensor | None = None
    score_mod: str | None = None
    mask_mod: str | None = None
    mod_inputs: Mapping[str, Any] = field(default_factory=dict)
    head_offset: int = 0

    @property
    def positional(self) -> bool:
        """Whether scores depend on positions (then a call covers consecutive positions)."""
        return self.alibi is not None or self.score_mod is not None or self.mask_mod is not None


def block_kwargs(call: BlockCall, options: Options, device: torch.device) -> dict[str, Any]:
    """attention()/attention_backward() keyword arguments of one block."""
    kw: dict[str, Any] = {"causal": call.causal, "scale": options.scale}
    if call.window is not None:
        kw["window_size"] = call.window
    if options.softcap is not None:
        kw["softcap"] = options.softcap
    score_mod, inputs = options.score_mod, dict(options.mod_inputs)
    if options.alibi is not None:
        if call.aligned:
            kw["alibi_slopes"] = options.alibi
        else:
            score_mod = with_alibi(score_mod)
            inputs[ALIBI_INPUT] = options.alibi
    if score_mod is not None or options.mask_mod is not None:
        start = [call.q_start, call.k_start, options.head_offset]
        inputs[POSITIONS_INPUT] = torch.tensor(start, dtype=torch.int32, device=device)
        kw.update(score_mod=score_mod, mask_mod=options.mask_mod, mod_inputs=inputs)
    return kw


def _rows(x: torch.Tensor, bounds: tuple[int, int]) -> torch.Tensor:
    return x.narrow(2, bounds[0], bounds[1] - bounds[0])


def merge(
    acc_out: torch.Tensor, acc_lse: torch.Tensor, out: torch.Tensor, lse: torch.Tensor
) -> None:
    """Fold the partial ``(out, lse)`` into the fp32 accumulators in place (the monoid)."""
    total = torch.logaddexp(acc_lse, lse)
    safe = torch.where(torch.isneginf(total), torch.zeros_like(total), total)
    acc_out.mul_(torch.exp(acc_lse - safe).unsqueeze(-1))
    acc_out.add_(torch.exp(lse - safe).unsqueeze(-1) * out.float())
    acc_lse.copy_(total)


def fold_sinks(acc_out: torch.Tensor, acc_lse: torch.Tensor, sinks: torch.Tensor) -> None:
    """Fold each head's sink, the state ``(out 0, lse sink_h)``, into the accumulators."""
    sink = sinks.float()[None, :, None].expand_as(acc_lse)
    total = torch.logaddexp(acc_lse, sink)
    acc_out.mul_(torch.exp(acc_lse - total).unsqueeze(-1))
    acc_lse.copy_(total)


def forward_blocks(
    calls: Iterable[BlockCall],
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    options: Options,
    acc_out: torch.Tensor,
    acc_lse: torch.Tensor,
) -> int:
    """Run each block of q against k, v and merge it into the accumulators; returns the number
    of calls made."""
    made = 0
    for call in calls:
        kw = block_kwargs(call, options, q.device)
        out, lse = attention(
            _rows(q, call.q_rows), _rows(k, call.k_rows), _rows(v, call.k_rows),
            return_lse=True, **kw,
        )  # fmt: skip
        merge(_rows(acc_out, call.q_rows), _rows(acc_lse, call.q_rows), out, lse)
        made += 1
    return made


def backward_blocks(
    calls: Iterable[BlockCall],
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    options: Options,
    dq: torch.Tensor,
    dk: torch.Tensor,
    dv: torch.Tensor,
) -> int:
    """Add each block's exact share of dq (rows of q) and dk, dv (rows of k, v) into the fp32
    accumulators; ``out`` and ``lse`` are the global ones. Returns the number of calls made."""
    made = 0
    for call in calls:
        kw = block_kwargs(call, options, q.device)
        rows, keys = call.q_rows, call.k_rows
        grads = attention_backward(
            _rows(dout, rows), _rows(q, rows), _rows(k, keys), _rows(v, keys),
            _rows(out, rows), _rows(lse, rows).contiguous(), **kw,
        )  # fmt: skip
        _rows(dq, rows).add_(grads[0].float())
        _rows(dk, keys).add_(grads[1].float())
        _rows(dv, keys).add_(grads[2].float())
        made += 1
    return made


def sink_gradient(
    dout: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor
) -> torch.Tensor:
    """This rank's share of d(loss)/d(sinks): the sink is a key of value 0, so its dS is
    ``-P_sink D`` with ``D = dout . out``; summed over the rank's rows (fp32, (H,))."""
    delta = (dout.float() * out.float()).sum(-1)
    weight = torch.exp(sinks.float()[None, :, None] - lse)
    return -(weight * delta).sum(dim=(0, 2))
