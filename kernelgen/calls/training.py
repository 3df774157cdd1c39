"""``kernelgen.attention``: the forward of :mod:`kernelgen.calls.attention`, differentiable by torch
autograd.

A call whose torch q, k, v or sinks requires grad while autograd records (``torch.no_grad`` and
``torch.inference_mode`` off) goes through :class:`kernelgen.calls.autograd.AttentionFunction`;
every other call (NumPy, CuPy, torch inference) is :func:`kernelgen.calls.attention.attention`
itself, after a check of q's type. See docs/backward.md, "torch autograd".
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from kernelgen.calls.attention import Layout, check_flags
from kernelgen.calls.attention import attention as forward_attention
from kernelgen.calls.block_mask import BlockMask
from kernelgen.calls.fp8 import fp8_attention, wants_fp8
from kernelgen.calls.variant_inputs import VariantArgs
from kernelgen.specs.forward import KernelSpec

__all__ = ["attention"]


def attention(
    q: Any,
    k: Any,
    v: Any,
    *,
    causal: bool = False,
    scale: float | None = None,
    mask: Any = None,
    spec: KernelSpec | None = None,
    return_lse: bool = False,
    layout: Layout = "bhsd",
    seqlens_k: Any = None,
    num_splits: int | None = None,
    window_size: tuple[int, int] | None = None,
    softcap: float | None = None,
    alibi_slopes: Any = None,
    sinks: Any = None,
    score_mod: Any = None,
    mask_mod: Any = None,
    mod_inputs: Mapping[str, Any] | None = None,
    block_mask: BlockMask | None = None,
    validate: bool = False,
    deterministic: bool = False,
    q_descale: Any = None,
    k_descale: Any = None,
    v_descale: Any = None,
) -> Any:
    """kernelgen.calls.attention.attention, differentiable (the full text is set below)."""
    if deterministic is not False and deterministic is not True:
        check_flags(deterministic=deterministic)
    variants = VariantArgs(
        window_size, softcap, alibi_slopes, sinks, score_mod, mask_mod, mod_inputs, block_mask
    )
    if wants_fp8(q, k, v, q_descale, k_descale, v_descale):  # forward only: no grad
        descales = {"q_descale": q_descale, "k_descale": k_descale, "v_descale": v_descale}
        return fp8_attention(
            q, k, v, causal=causal, scale=scale, spec=spec, return_lse=return_lse,
            layout=layout, descales=descales, seqlens_k=seqlens_k,
            variants=variants,
            unsupported={"mask": mask, "num_splits": num_splits,
                         "deterministic": deterministic or None},
        )  # fmt: skip
    if (
        seqlens_k is None
        and type(q).__module__.startswith("torch")
        and _records_grad(q, k, v, sinks)
    ):
        check_flags(causal=causal, return_lse=return_lse, validate=validate)
        from kernelgen.calls.autograd import AttentionOptions, differentiable_attention

        options = AttentionOptions(
            causal=bool(causal),
            scale=scale,
            layout=layout,
            spec=spec,
            num_splits=num_splits,
            variants=replace(variants, alibi_slopes=None, sinks=None),  # Function inputs
            validate=bool(validate),
            deterministic=bool(deterministic),
        )
        return differentiable_attention(
            q,
            k,
            v,
            mask=mask,
            alibi_slopes=alibi_slopes,
            sinks=sinks,
            return_lse=bool(return_lse),
            options=options,
        )
    return forward_attention(
        q,
        k,
        v,
        causal=causal,
        scale=scale,
        mask=mask,
        spec=spec,
        return_lse=return_lse,
        layout=layout,
        seqlens_k=seqlens_k,
        num_splits=num_splits,
        **variants.keywords(),
        validate=validate,
    )


def _records_grad(q: Any, k: Any, v: Any, sinks: Any) -> bool:
    """Whether autograd records this torch call: an input requires grad, grad mode is on."""
    if not (
        getattr(q, "requires_grad", False)
        or getattr(k, "requires_grad", False)
        or getattr(v, "requires_grad", False)
        or getattr(sinks, "requires_grad", False)
    ):
        return False
    return bool(sys.modules["torch"].is_grad_enabled())


_DIFFERENTIABLE = """\
    Differentiable by torch autograd (docs/backward.md): when a torch q, k, v or sinks requires
    grad and grad mode is on, a loss's ``backward()`` (e.g. ``out.sum().backward()``) fills
    their ``.grad`` through :func:`kernelgen.attention_backward`. No gradient flows into
    ``mask``, ``alibi_slopes``, ``mod_inputs`` or through the returned lse; the backward of a
    ``mask_mod`` or ``block_mask`` call is block-sparse (it skips the tiles the mask hides);
    calls with ``seqlens_k`` are not differentiable (they warn once and return detached
    outputs). ``deterministic=True`` (or ``torch.use_deterministic_algorithms(True)``) makes the
    backward bitwise reproducible, at some cost; the forward ignores it. No double backward.
    fp8 calls have no backward: an fp8 input that requires grad raises InputError.

    fp8 (docs/hopper.md, fp8): q, k and v as torch.float8_e4m3fn tensors (CUDA, on a compute
    capability 9.0 device, or CPU: the emulator) or NumPy ``ml_dtypes.float8_e4m3fn`` arrays
    (the emulator), head dim 128, causal or not, GQA/MQA, either layout, with optional
    ``q_descale``, ``k_descale``, ``v_descale``: float32 (B, Hkv) arrays of q's library and
    device (the inputs' values are the e4m3 values times these; None: 1). out is bfloat16 in
    the call's layout, lse float32; no mask, variants, expressions, seqlens_k, split-KV or
    backward (kernelgen.calls.fp8)."""


def _docstring() -> str | None:
    """The forward's docstring with its "forward pass only" paragraph made this one's."""
    if forward_attention.__doc__ is None:  # python -OO
        return None
    paragraphs = forward_attention.__doc__.split("\n\n")
    return "\n\n".join([paragraphs[0], _DIFFERENTIABLE, *paragraphs[2:]])


attention.__doc__ = _docstring()
