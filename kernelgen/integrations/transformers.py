"""kernelgen as a Hugging Face transformers attention implementation.

Importing this module registers ``"kernelgen"`` with transformers' ``AttentionInterface`` (the
attention function) and ``AttentionMaskInterface`` (the masks it gets: transformers' SDPA masks,
boolean or None), so that any model built on the attention interface runs with it::

    import kernelgen.integrations.transformers  # noqa: F401  (registers "kernelgen")

    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="kernelgen")

CUDA tensors run on the GPU; CPU tensors run the generated kernels in the emulator (for
correctness, not speed). The call goes through ``torch.ops.kernelgen.attention``
(:mod:`kernelgen.torch_ops`), so compiled models trace through it and training differentiates
it (its backward: :func:`kernelgen.attention_backward`). No attention dropout, no logit
soft-capping, no attention sinks.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from kernelgen.errors import InputError
from kernelgen.torch_ops import attention

__all__ = ["NAME", "kernelgen_attention_forward", "register"]

NAME = "kernelgen"
_UNSUPPORTED = ("softcap", "s_aux")  # keyword arguments some models pass: refused when set


def kernelgen_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: query (B, H, Sq, D), key and value
    (B, Hkv, Sk, D) (GQA: kernelgen reads the shared heads, nothing is repeated), the mask of
    transformers' SDPA path ((B, 1, Sq, Sk), True: attend; or None: ``is_causal`` applies, from
    the keyword or ``module.is_causal``). Returns (out (B, Sq, H, D), None): no weights."""
    if dropout:
        raise InputError(f"dropout={dropout} is not supported by kernelgen (no attention dropout)")
    for name in _UNSUPPORTED:
        if kwargs.get(name) is not None:
            raise InputError(f"{name} is not supported by kernelgen's attention")
    is_causal = kwargs.get("is_causal")
    if is_causal is None:
        is_causal = getattr(module, "is_causal", True)
    mask = None
    if attention_mask is not None:
        mask = attention_mask
        if mask.dtype == torch.bool:  # additive: 0 where attended, -inf elsewhere
            zero = torch.zeros((), dtype=torch.float32, device=mask.device)
            mask = torch.where(mask, zero, float("-inf"))
        is_causal = False  # the mask holds the causal pattern (and padding, windows)
    # bottom-right aligned causal (kernelgen's): right for a KV cache, where Sk >= Sq
    out = attention(query, key, value, causal=bool(is_causal), scale=scaling, mask=mask)
    return out.transpose(1, 2).contiguous(), None


def register(name: str = NAME) -> None:
    """Register the attention function and its mask under ``name`` (done on import for
    ``"kernelgen"``)."""
    AttentionInterface.register(name, kernelgen_attention_forward)
    AttentionMaskInterface.register(name, sdpa_mask)


register()
