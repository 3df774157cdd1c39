"""``kernelgen.attention`` as a torch operator, ``torch.ops.kernelgen.attention``, so that
``torch.compile`` (``fullgraph=True`` included) and ``torch.export`` trace through it.

Importing this module registers the operator (torch is optional: kernelgen itself never imports
this module). The operator takes CUDA tensors (the GPU path) and CPU tensors (the CPU backend,
the emulator); its fake implementation gives the output shapes and dtypes from the inputs'
metadata alone::

    import kernelgen.torch_ops as kt

    out = kt.attention(q, k, v, causal=True)  # in a torch.compile'd function too

There is no autograd formula: it is a forward (inference) operator. Inputs that require grad
give outputs whose backward raises; ``kernelgen.attention`` itself warns once and returns outputs
detached from the graph.

The operator's schema: ``kernelgen::attention(Tensor q, Tensor k, Tensor v, Tensor? mask=None,
bool causal=False, float? scale=None, str layout="bhsd", Tensor? seqlens_k=None, SymInt?
num_splits=None, SymInt[]? window=None, float? softcap=None, Tensor? alibi_slopes=None, Tensor?
sinks=None) -> (Tensor, Tensor)``: out and the fp32 log-sum-exp.
"""

from __future__ import annotations

import torch

from kernelgen.api import attention as _attention

__all__ = ["attention"]


def _lse_shape(q: torch.Tensor, layout: str) -> tuple[int, int, int]:
    batch, dim1, dim2, _ = q.shape
    return (batch, dim1, dim2) if layout == "bhsd" else (batch, dim2, dim1)


@torch.library.custom_op("kernelgen::attention", mutates_args=())
def _attention_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None = None,
    causal: bool = False,
    scale: float | None = None,
    layout: str = "bhsd",
    seqlens_k: torch.Tensor | None = None,
    num_splits: int | None = None,
    window: list[int] | None = None,
    softcap: float | None = None,
    alibi_slopes: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """out in q's layout and dtype, and the fp32 log-sum-exp (B, H, Sq): :func:`kernelgen.attention`
    with ``return_lse=True`` (an operator's outputs are fixed). Every argument after q, k, v has
    kernelgen.attention's default: ``torch.ops.kernelgen.attention(q, k, v, causal=True)``."""
    return _attention(
        q,
        k,
        v,
        causal=causal,
        scale=scale,
        mask=mask,
        layout=layout,  # type: ignore[arg-type]
        seqlens_k=seqlens_k,
        num_splits=num_splits,
        return_lse=True,
        window_size=None if window is None else (window[0], window[1]),
        softcap=softcap,
        alibi_slopes=alibi_slopes,
        sinks=sinks,
    )


@_attention_op.register_fake
def _attention_fake(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None = None,
    causal: bool = False,
    scale: float | None = None,
    layout: str = "bhsd",
    seqlens_k: torch.Tensor | None = None,
    num_splits: int | None = None,
    window: list[int] | None = None,
    softcap: float | None = None,
    alibi_slopes: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    out = q.new_empty(q.shape)
    lse = q.new_empty(_lse_shape(q, layout), dtype=torch.float32)
    return out, lse


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    scale: float | None = None,
    mask: torch.Tensor | None = None,
    return_lse: bool = False,
    layout: str = "bhsd",
    seqlens_k: torch.Tensor | None = None,
    num_splits: int | None = None,
    window_size: tuple[int, int] | None = None,
    softcap: float | None = None,
    alibi_slopes: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """:func:`kernelgen.attention` on torch tensors through ``torch.ops.kernelgen.attention``
    (same arguments, but no ``spec``, and ``seqlens_k`` a tensor); traceable by torch.compile.
    The variants (docs/variants.md) as in ``kernelgen.attention``."""
    window = None if window_size is None else [int(side) for side in window_size]
    out, lse = torch.ops.kernelgen.attention(
        q, k, v, mask, bool(causal), scale, layout, seqlens_k, num_splits,
        window, softcap, alibi_slopes, sinks,
    )  # fmt: skip
    return (out, lse) if return_lse else out
