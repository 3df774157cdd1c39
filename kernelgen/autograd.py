"""kernelgen attention as a ``torch.autograd.Function`` (docs/backward.md, "torch autograd").

:class:`AttentionFunction` runs the forward (:func:`kernelgen.api.attention` with
``return_lse=True``), saves q, k, v, out and lse, and its backward calls
:func:`kernelgen.attention_backward`. :func:`kernelgen.attention` (kernelgen.training) routes
here when a torch input requires grad while autograd records; this module imports torch, so
kernelgen imports it only then.

Gradients flow into q, k, v and sinks. None flows into ``mask``, ``alibi_slopes`` or
``mod_inputs`` (treated as constants, like flash-attn's bias-free kernels), nor through the
log-sum-exp (a non-differentiable output). The backward is not itself differentiable (no double
backward: ``once_differentiable`` raises).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.autograd.function import once_differentiable

from kernelgen.api import attention as forward_attention
from kernelgen.backward_api import attention_backward

__all__ = ["AttentionFunction", "AttentionOptions", "differentiable_attention"]


@dataclass(frozen=True)
class AttentionOptions:
    """A differentiable call's arguments besides its tensors (q, k, v, sinks, mask, slopes)."""

    causal: bool = False
    scale: float | None = None
    layout: str = "bhsd"
    spec: Any = None  # the forward's KernelSpec (the backward takes the policy's default)
    num_splits: int | None = None
    window_size: tuple[int, int] | None = None
    softcap: float | None = None
    score_mod: Any = None
    mask_mod: Any = None
    mod_inputs: Mapping[str, Any] | None = None
    block_mask: Any = None
    validate: bool = False
    deterministic: bool = False

    def forward_options(self) -> dict[str, Any]:
        """The keyword arguments of :func:`kernelgen.api.attention` (all but the tensors)."""
        return {
            "causal": self.causal,
            "scale": self.scale,
            "layout": self.layout,
            "spec": self.spec,
            "num_splits": self.num_splits,
            "window_size": self.window_size,
            "softcap": self.softcap,
            "score_mod": self.score_mod,
            "mask_mod": self.mask_mod,
            "mod_inputs": self.mod_inputs,
            "block_mask": self.block_mask,
            "validate": self.validate,
        }


class AttentionFunction(torch.autograd.Function):
    """``(out, lse) = attention(q, k, v, ...)`` with gradients for q, k, v and sinks."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        sinks: torch.Tensor | None,
        mask: torch.Tensor | None,
        alibi_slopes: torch.Tensor | None,
        options: AttentionOptions,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        out, lse = forward_attention(
            q,
            k,
            v,
            mask=mask,
            alibi_slopes=alibi_slopes,
            sinks=sinks,
            return_lse=True,
            **options.forward_options(),
        )
        ctx.mark_non_differentiable(lse)
        ctx.save_for_backward(q, k, v, out, lse, sinks, mask, alibi_slopes)
        ctx.options = options
        return out, lse

    @staticmethod
    @once_differentiable
    def backward(  # type: ignore[override]
        ctx: Any, dout: torch.Tensor, _dlse: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, ...]:
        q, k, v, out, lse, sinks, mask, alibi_slopes = ctx.saved_tensors
        options: AttentionOptions = ctx.options
        grads = attention_backward(
            dout.contiguous(),  # e.g. sum()'s gradient: one value, expanded (stride 0)
            q,
            k,
            v,
            out,
            lse,
            causal=options.causal,
            scale=options.scale,
            mask=mask,
            layout=options.layout,
            window_size=options.window_size,
            softcap=options.softcap,
            alibi_slopes=alibi_slopes,
            sinks=sinks,
            score_mod=options.score_mod,
            mask_mod=options.mask_mod,
            mod_inputs=options.mod_inputs,
            block_mask=options.block_mask,  # block-sparse backward (docs/backward.md)
            deterministic=options.deterministic or torch.are_deterministic_algorithms_enabled(),
        )
        wanted = ctx.needs_input_grad
        dq, dk, dv = (g if wanted[i] else None for i, g in enumerate(grads[:3]))
        dsinks = grads[3] if sinks is not None and wanted[3] else None
        return dq, dk, dv, dsinks, None, None, None


def differentiable_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    mask: torch.Tensor | None,
    alibi_slopes: torch.Tensor | None,
    sinks: torch.Tensor | None,
    return_lse: bool,
    options: AttentionOptions,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """out (and with ``return_lse`` the lse, which carries no gradient) on the autograd graph."""
    out, lse = AttentionFunction.apply(q, k, v, sinks, mask, alibi_slopes, options)
    return (out, lse) if return_lse else out
