"""kernelgen attention as a ``torch.autograd.Function`` (docs/backward.md, "torch autograd").

:class:`AttentionFunction` runs the forward (:func:`kernelgen.calls.attention.attention` with
``return_lse=True``), saves q, k, v, out and lse, and its backward calls
:func:`kernelgen.attention_backward`. :func:`kernelgen.attention` (kernelgen.calls.training) routes
here when a torch input requires grad while autograd records; this module imports torch, so
kernelgen imports it only then.

Gradients flow into q, k, v and sinks. None flows into ``mask``, ``alibi_slopes`` or
``mod_inputs`` (treated as constants, like flash-attn's bias-free kernels), nor through the
log-sum-exp (a non-differentiable output). The backward is not itself differentiable (no double
backward: ``once_differentiable`` raises).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
from torch.autograd.function import once_differentiable

from kernelgen.calls.attention import attention as forward_attention
from kernelgen.calls.backward import attention_backward
from kernelgen.calls.variant_inputs import NO_VARIANTS, VariantArgs

__all__ = ["AttentionFunction", "AttentionOptions", "differentiable_attention"]


@dataclass(frozen=True)
class AttentionOptions:
    """A differentiable call's arguments besides its tensors (q, k, v, sinks, mask, slopes)."""

    causal: bool = False
    scale: float | None = None
    layout: str = "bhsd"
    spec: Any = None  # the forward's KernelSpec (the backward takes the policy's default)
    num_splits: int | None = None
    # the variants and expressions; the arrays (alibi_slopes, sinks) travel as Function inputs
    variants: VariantArgs = NO_VARIANTS
    validate: bool = False
    deterministic: bool = False

    def forward_options(self) -> dict[str, Any]:
        """The keyword arguments of :func:`kernelgen.calls.attention.attention` but the tensors."""
        return {
            "causal": self.causal,
            "scale": self.scale,
            "layout": self.layout,
            "spec": self.spec,
            "num_splits": self.num_splits,
            "validate": self.validate,
        }

    def variant_keywords(self, alibi_slopes: Any, sinks: Any) -> dict[str, Any]:
        """The variants' keyword arguments with the call's arrays."""
        return replace(self.variants, alibi_slopes=alibi_slopes, sinks=sinks).keywords()


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
            return_lse=True,
            **options.forward_options(),
            **options.variant_keywords(alibi_slopes, sinks),
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
            # with a block_mask or mask_mod: the block-sparse backward (docs/backward.md)
            **options.variant_keywords(alibi_slopes, sinks),
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
