"""``kernelgen.attention`` as a torch operator, ``torch.ops.kernelgen.attention``, so that
``torch.compile`` (``fullgraph=True`` included) and ``torch.export`` trace through it, forward
and backward.

Importing this module registers the operator (torch is optional: kernelgen itself never imports
this module). The operator takes CUDA tensors (the GPU path) and CPU tensors (the CPU backend,
the emulator); its fake implementation gives the output shapes and dtypes from the inputs'
metadata alone::

    import kernelgen.torch_ops as kt

    out = kt.attention(q, k, v, causal=True)  # in a torch.compile'd function too

Its autograd formula (``torch.library.register_autograd``) calls a second operator,
``torch.ops.kernelgen.attention_backward`` (:func:`kernelgen.attention_backward`, with its own
fake implementation), so a compiled training step traces both passes. Gradients flow into q, k,
v and sinks; none into mask, alibi_slopes or mod_inputs, nor through the log-sum-exp
(non-differentiable). Calls with ``seqlens_k`` have no backward (it raises). ``deterministic`` (or
``torch.use_deterministic_algorithms(True)``) makes the backward bitwise reproducible.

The operators' schemas: ``kernelgen::attention(Tensor q, Tensor k, Tensor v, Tensor?
mask=None, bool causal=False, float? scale=None, str layout="bhsd", Tensor? seqlens_k=None,
SymInt? num_splits=None, SymInt[]? window=None, float? softcap=None, Tensor? alibi_slopes=None,
Tensor? sinks=None, bool deterministic=False, Tensor? q_descale=None, Tensor? k_descale=None,
Tensor? v_descale=None, str? score_mod=None, str? mask_mod=None, Tensor[]? mod_inputs=None, str?
mod_input_names=None, Tensor[]? block_mask=None, SymInt[]? block_mask_sizes=None, str?
block_mask_mod=None, str? block_mask_inputs=None) -> (Tensor, Tensor)``: out and the fp32
log-sum-exp (the descales, then the expressions, added last, leave positional callers of the
older schemas as they were); ``kernelgen::attention_backward(Tensor dout, Tensor q, Tensor k,
Tensor v, Tensor out, Tensor lse, Tensor? mask, bool causal, float? scale, str layout, SymInt[]?
window, float? softcap, Tensor? alibi_slopes, Tensor? sinks, bool deterministic, str?
score_mod=None, str? mask_mod=None, Tensor[]? mod_inputs=None, str? mod_input_names=None,
Tensor[]? block_mask=None, SymInt[]? block_mask_sizes=None, str? block_mask_mod=None, str?
block_mask_inputs=None) -> (Tensor, Tensor, Tensor, Tensor)``: dq, dk, dv and dsinks (fp32;
empty, shape (0,), without sinks).

User expressions and block masks (docs/expressions.md): :func:`attention` takes
kernelgen.attention's ``score_mod``, ``mask_mod``, ``mod_inputs`` (name -> tensor) and
``block_mask`` (``kernelgen.block_mask(..., like=q)``) and passes them as the schemas' last
eight arguments (:mod:`kernelgen.calls.op_expressions`: the texts, the tensors with their names
joined by commas, a block mask's four lists with its sizes, its mask_mod's text and inputs);
the operator rebuilds them and kernelgen's checks run on them, in the fake implementations too
(on metadata), so a bad call fails when traced. The backward operator gets the same ones
(block-sparse with a mask_mod or block mask). No gradient flows into mod_inputs. A score_mod
the backward cannot differentiate (``//`` or ``%`` of the score) raises InputError from the
autograd context, when the call is recorded or traced.

fp8: with q, k and v ``torch.float8_e4m3fn`` (and optional float32 (B, Hkv) descales, the last
three arguments) the operator runs the fp8 wgmma forward (:mod:`kernelgen.calls.fp8`,
docs/hopper.md "fp8"): out is bfloat16 in q's layout, the lse float32. Its fake implementation
runs the fp8 call's metadata checks, so a bad fp8 call fails when traced. fp8 has no backward:
an fp8 input that requires grad while autograd records raises InputError from the operator's
autograd context (which torch runs after the forward, or when it traces the call).
"""

from __future__ import annotations

from typing import Any

import torch

from kernelgen.calls.attention import attention as _attention
from kernelgen.calls.attention import (
    check_expression_libraries,
    check_flags,
    check_inputs,
    describe,
)
from kernelgen.calls.backward import attention_backward as _attention_backward
from kernelgen.calls.fp8 import check_fp8_call, fp8_attention, wants_fp8
from kernelgen.calls.op_expressions import (
    OP_ARGUMENTS,
    call_keywords,
    join_tensors,
    op_values,
    split_tensors,
)
from kernelgen.calls.variant_inputs import VariantArgs
from kernelgen.errors import InputError
from kernelgen.runtime.frameworks import arrays_of, device_of
from kernelgen.specs.expression_grad import score_mod_derivative
from kernelgen.specs.expressions import checked_expression, inputs_from_arrays

__all__ = ["attention"]

# The schemas, written out: torch.library infers no ``Tensor[]?`` (mod_inputs, block_mask).
_EXPRESSIONS = (
    "str? score_mod=None, str? mask_mod=None, Tensor[]? mod_inputs=None, "
    "str? mod_input_names=None, Tensor[]? block_mask=None, SymInt[]? block_mask_sizes=None, "
    "str? block_mask_mod=None, str? block_mask_inputs=None"
)
FORWARD_SCHEMA = (
    "(Tensor q, Tensor k, Tensor v, Tensor? mask=None, bool causal=False, float? scale=None, "
    'str layout="bhsd", Tensor? seqlens_k=None, SymInt? num_splits=None, SymInt[]? window=None, '
    "float? softcap=None, Tensor? alibi_slopes=None, Tensor? sinks=None, bool "
    "deterministic=False, Tensor? q_descale=None, Tensor? k_descale=None, Tensor? "
    f"v_descale=None, {_EXPRESSIONS}) -> (Tensor, Tensor)"
)
BACKWARD_SCHEMA = (
    "(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor? mask, bool "
    "causal, float? scale, str layout, SymInt[]? window, float? softcap, Tensor? alibi_slopes, "
    f"Tensor? sinks, bool deterministic, {_EXPRESSIONS}) -> (Tensor, Tensor, Tensor, Tensor)"
)


def _fp8_arguments(
    mask: torch.Tensor | None,
    causal: bool,
    scale: float | None,
    layout: str,
    seqlens_k: torch.Tensor | None,
    num_splits: int | None,
    window: list[int] | None,
    softcap: float | None,
    alibi_slopes: torch.Tensor | None,
    sinks: torch.Tensor | None,
    deterministic: bool,
    descales: tuple[torch.Tensor | None, ...],
    expressions: dict[str, Any],
) -> dict[str, Any]:
    """The operator's arguments as those of :func:`kernelgen.calls.fp8.check_fp8_call` and
    :func:`~kernelgen.calls.fp8.fp8_attention` (always with the lse); ``expressions``: the
    rebuilt user expressions (:func:`kernelgen.calls.op_expressions.call_keywords`)."""
    unsupported = {
        "mask": mask, "num_splits": num_splits, "deterministic": deterministic or None,
    }  # fmt: skip
    variants = VariantArgs(
        window_size=None if window is None else tuple(window), softcap=softcap,
        alibi_slopes=alibi_slopes, sinks=sinks, **expressions,
    )  # fmt: skip
    return {
        "causal": causal,
        "scale": scale,
        "spec": None,
        "return_lse": True,
        "layout": layout,
        "descales": dict(zip(("q_descale", "k_descale", "v_descale"), descales, strict=True)),
        "unsupported": unsupported,
        "variants": variants,
        "seqlens_k": seqlens_k,
    }


def _lse_shape(q: torch.Tensor, layout: str) -> tuple[int, int, int]:
    batch, dim1, dim2, _ = q.shape
    return (batch, dim1, dim2) if layout == "bhsd" else (batch, dim2, dim1)


def _window_size(window: list[int] | None) -> tuple[int, int] | None:
    return None if window is None else (window[0], window[1])


def _check_metadata(
    tensors: tuple[torch.Tensor, ...], options: dict[str, Any], expressions: dict[str, Any]
) -> None:
    """kernelgen.attention's checks on metadata only (the fake implementations): q, k, v and
    ``mask`` (``tensors``), the variants and the user expressions, a block mask's lists."""
    q, k, v, mask = tensors
    block_mask = expressions["block_mask"]
    if block_mask is not None:
        block_mask.check_arrays(arrays_of(q).name, device_of(q))
    variants = VariantArgs(
        _window_size(options["window"]), options["softcap"], options["alibi_slopes"],
        options["sinks"], **expressions,
    )  # fmt: skip
    call = check_inputs(
        describe(q, "q"), describe(k, "k"), describe(v, "v"),
        describe(mask, "mask") if mask is not None else None, layout=options["layout"],
        scale=options["scale"], spec=None, causal=bool(options["causal"]), variants=variants,
    )  # fmt: skip
    check_expression_libraries(q, call.expressions)


@torch.library.custom_op("kernelgen::attention", mutates_args=(), schema=FORWARD_SCHEMA)
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
    deterministic: bool = False,
    q_descale: torch.Tensor | None = None,
    k_descale: torch.Tensor | None = None,
    v_descale: torch.Tensor | None = None,
    score_mod: str | None = None,
    mask_mod: str | None = None,
    mod_inputs: list[torch.Tensor] | None = None,
    mod_input_names: str | None = None,
    block_mask: list[torch.Tensor] | None = None,
    block_mask_sizes: list[int] | None = None,
    block_mask_mod: str | None = None,
    block_mask_inputs: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """out in q's layout and dtype, and the fp32 log-sum-exp (B, H, Sq): :func:`kernelgen.attention`
    with ``return_lse=True`` (an operator's outputs are fixed). Every argument after q, k, v has
    kernelgen.attention's default: ``torch.ops.kernelgen.attention(q, k, v, causal=True)``.
    ``deterministic``: the backward's (the forward ignores it). fp8 q, k, v (or a descale given):
    the fp8 forward, out in bfloat16 (:mod:`kernelgen.calls.fp8`). The last eight arguments are
    the user expressions and block mask (:mod:`kernelgen.calls.op_expressions`)."""
    expressions = call_keywords(score_mod, mask_mod, mod_inputs, mod_input_names, block_mask,
                                block_mask_sizes, block_mask_mod, block_mask_inputs,
                                reuse=True)  # fmt: skip
    descales = (q_descale, k_descale, v_descale)
    if wants_fp8(q, k, v, *descales):
        fp8 = _fp8_arguments(mask, causal, scale, layout, seqlens_k, num_splits, window,
                             softcap, alibi_slopes, sinks, deterministic, descales,
                             expressions)  # fmt: skip
        return fp8_attention(q, k, v, **fp8)
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
        window_size=_window_size(window),
        softcap=softcap,
        alibi_slopes=alibi_slopes,
        sinks=sinks,
        **expressions,
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
    deterministic: bool = False,
    q_descale: torch.Tensor | None = None,
    k_descale: torch.Tensor | None = None,
    v_descale: torch.Tensor | None = None,
    score_mod: str | None = None,
    mask_mod: str | None = None,
    mod_inputs: list[torch.Tensor] | None = None,
    mod_input_names: str | None = None,
    block_mask: list[torch.Tensor] | None = None,
    block_mask_sizes: list[int] | None = None,
    block_mask_mod: str | None = None,
    block_mask_inputs: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    expressions = call_keywords(score_mod, mask_mod, mod_inputs, mod_input_names, block_mask,
                                block_mask_sizes, block_mask_mod, block_mask_inputs)  # fmt: skip
    descales = (q_descale, k_descale, v_descale)
    out_dtype = q.dtype
    if wants_fp8(q, k, v, *descales):  # the eager call's checks, on metadata; out in bfloat16
        fp8 = _fp8_arguments(mask, causal, scale, layout, seqlens_k, num_splits, window,
                             softcap, alibi_slopes, sinks, deterministic, descales,
                             expressions)  # fmt: skip
        check_fp8_call(q, k, v, **fp8)
        out_dtype = torch.bfloat16
    else:
        options = {"causal": causal, "scale": scale, "layout": layout, "window": window,
                   "softcap": softcap, "alibi_slopes": alibi_slopes, "sinks": sinks}  # fmt: skip
        _check_metadata((q, k, v, mask), options, expressions)
    out = q.new_empty(q.shape, dtype=out_dtype)
    lse = q.new_empty(_lse_shape(q, layout), dtype=torch.float32)
    return out, lse


@torch.library.custom_op("kernelgen::attention_backward", mutates_args=(), schema=BACKWARD_SCHEMA)
def _attention_backward_op(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    mask: torch.Tensor | None,
    causal: bool,
    scale: float | None,
    layout: str,
    window: list[int] | None,
    softcap: float | None,
    alibi_slopes: torch.Tensor | None,
    sinks: torch.Tensor | None,
    deterministic: bool,
    score_mod: str | None = None,
    mask_mod: str | None = None,
    mod_inputs: list[torch.Tensor] | None = None,
    mod_input_names: str | None = None,
    block_mask: list[torch.Tensor] | None = None,
    block_mask_sizes: list[int] | None = None,
    block_mask_mod: str | None = None,
    block_mask_inputs: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv (q's and k's layout and dtype, contiguous) and dsinks (fp32 (H,), or empty
    without sinks): :func:`kernelgen.attention_backward` (an operator's outputs are fixed); with
    a mask_mod or block mask, its block-sparse backward."""
    expressions = call_keywords(score_mod, mask_mod, mod_inputs, mod_input_names, block_mask,
                                block_mask_sizes, block_mask_mod, block_mask_inputs,
                                reuse=True)  # fmt: skip
    grads = _attention_backward(
        dout,
        q,
        k,
        v,
        out,
        lse,
        causal=causal,
        scale=scale,
        mask=mask,
        layout=layout,
        window_size=_window_size(window),
        softcap=softcap,
        alibi_slopes=alibi_slopes,
        sinks=sinks,
        deterministic=deterministic,
        **expressions,
    )
    dsinks = grads[3] if sinks is not None else q.new_empty((0,), dtype=torch.float32)
    return grads[0], grads[1], grads[2], dsinks


@_attention_backward_op.register_fake
def _attention_backward_fake(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    mask: torch.Tensor | None,
    causal: bool,
    scale: float | None,
    layout: str,
    window: list[int] | None,
    softcap: float | None,
    alibi_slopes: torch.Tensor | None,
    sinks: torch.Tensor | None,
    deterministic: bool,
    score_mod: str | None = None,
    mask_mod: str | None = None,
    mod_inputs: list[torch.Tensor] | None = None,
    mod_input_names: str | None = None,
    block_mask: list[torch.Tensor] | None = None,
    block_mask_sizes: list[int] | None = None,
    block_mask_mod: str | None = None,
    block_mask_inputs: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    expressions = call_keywords(score_mod, mask_mod, mod_inputs, mod_input_names, block_mask,
                                block_mask_sizes, block_mask_mod, block_mask_inputs)  # fmt: skip
    options = {"causal": causal, "scale": scale, "layout": layout, "window": window,
               "softcap": softcap, "alibi_slopes": alibi_slopes, "sinks": sinks}  # fmt: skip
    _check_metadata((q, k, v, mask), options, expressions)
    dsinks_shape = tuple(sinks.shape) if sinks is not None else (0,)
    return (
        q.new_empty(q.shape),
        k.new_empty(k.shape),
        k.new_empty(k.shape),
        q.new_empty(dsinks_shape, dtype=torch.float32),
    )


_INPUTS = ("q", "k", "v", "mask", "causal", "scale", "layout", "seqlens_k", "num_splits",
           "window", "softcap", "alibi_slopes", "sinks", "deterministic", "q_descale",
           "k_descale", "v_descale", *OP_ARGUMENTS)  # fmt: skip
_SAVED = 8  # q, k, v, out, lse, mask, alibi_slopes, sinks; then mod_inputs and block mask lists


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor, ...]) -> None:
    """Save what the backward reads; the lse carries no gradient. Runs only when autograd
    records the call, so an fp8 call, or a score_mod without a derivative, raises here."""
    args = dict(zip(_INPUTS, inputs, strict=True))
    _refuse_fp8_grad(args)
    _refuse_score_mod_without_derivative(args)
    out, lse = output
    ctx.mark_non_differentiable(lse)
    extra, ctx.counts = split_tensors(args)
    ctx.save_for_backward(
        args["q"], args["k"], args["v"], out, lse, args["mask"], args["alibi_slopes"],
        args["sinks"], *extra,
    )  # fmt: skip
    options = ("causal", "scale", "layout", "window", "softcap", "deterministic", *OP_ARGUMENTS)
    # mod_inputs and the block mask's lists are saved tensors
    ctx.options = {n: args[n] for n in options if n not in ("mod_inputs", "block_mask")}
    ctx.with_seqlens_k = args["seqlens_k"] is not None


def _refuse_fp8_grad(args: dict[str, Any]) -> None:
    """InputError for an fp8 call whose input requires grad (called from the autograd context,
    which torch runs, with grad mode off, only when autograd records the call)."""
    names = ("q", "k", "v", "q_descale", "k_descale", "v_descale")
    if not wants_fp8(*(args[name] for name in names)):
        return
    for name in (*names, "alibi_slopes", "sinks"):
        if getattr(args[name], "requires_grad", False):
            raise InputError(
                f"{name} requires grad, but fp8 attention has no backward pass (not built yet); "
                f"pass {name}.detach() or call it under torch.no_grad()"
            )


def _refuse_score_mod_without_derivative(args: dict[str, Any]) -> None:
    """InputError naming score_mod when the backward could not differentiate it (``//`` or
    ``%`` of the score, docs/expressions.md "Gradients"): when the call is recorded (or
    traced), not at backward time."""
    if args["score_mod"] is None:
        return
    expressions = call_keywords(*(args[name] for name in OP_ARGUMENTS))
    declared = inputs_from_arrays(expressions["mod_inputs"])
    score_mod_derivative(checked_expression("score_mod", args["score_mod"], declared))


def _backward(
    ctx: Any, dout: torch.Tensor, _dlse: torch.Tensor | None
) -> tuple[torch.Tensor | None, ...]:
    """Gradients for (q, k, v, ..., sinks, ...) in the forward's argument order: dq, dk, dv,
    dsinks, None for the rest (mask, alibi_slopes and mod_inputs included)."""
    if ctx.with_seqlens_k:
        raise InputError(
            "torch.ops.kernelgen.attention with seqlens_k has no backward pass; pass the keys "
            "without seqlens_k (or a mask) to differentiate"
        )
    q, k, v, out, lse, mask, alibi_slopes, sinks = ctx.saved_tensors[:_SAVED]
    options = dict(ctx.options)
    options.update(join_tensors(ctx.saved_tensors[_SAVED:], ctx.counts))
    options["deterministic"] = bool(
        options["deterministic"] or torch.are_deterministic_algorithms_enabled()
    )
    dq, dk, dv, dsinks = torch.ops.kernelgen.attention_backward(
        dout.contiguous(), q, k, v, out, lse, mask, options["causal"], options["scale"],
        options["layout"], options["window"], options["softcap"], alibi_slopes, sinks,
        options["deterministic"], *(options[name] for name in OP_ARGUMENTS),
    )  # fmt: skip
    wanted = ctx.needs_input_grad
    grads: list[Any] = [None] * len(_INPUTS)
    for name, count in ctx.counts.items():  # a tensor list's gradient: a list (of None)
        if count >= 0:
            grads[_INPUTS.index(name)] = [None] * count
    for index, grad in ((0, dq), (1, dk), (2, dv)):
        grads[index] = grad if wanted[index] else None
    if sinks is not None and wanted[12]:
        grads[12] = dsinks
    # one per argument as passed: the dispatcher drops trailing ones equal to their defaults,
    # and a schema with tensor lists wants exactly the structure of the inputs
    return tuple(grads[: len(wanted)])


_attention_op.register_autograd(_backward, setup_context=_setup_context)


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
    score_mod: Any = None,
    mask_mod: Any = None,
    mod_inputs: dict[str, torch.Tensor] | None = None,
    block_mask: Any = None,
    deterministic: bool = False,
    q_descale: torch.Tensor | None = None,
    k_descale: torch.Tensor | None = None,
    v_descale: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """:func:`kernelgen.attention` on torch tensors through ``torch.ops.kernelgen.attention``
    (same arguments, but no ``spec``, and ``seqlens_k`` a tensor); traceable by torch.compile,
    and differentiable (a compiled backward included). The variants (docs/variants.md) as in
    ``kernelgen.attention``. The user expressions (docs/expressions.md) too: ``score_mod`` and
    ``mask_mod`` strings, ``mod_inputs`` (name -> torch tensor of q's device: no gradient flows
    into them) and a ``block_mask`` built by ``kernelgen.block_mask(..., like=q)``; the backward
    takes the same expressions (block-sparse with a mask_mod or block mask). fp8:
    ``torch.float8_e4m3fn`` q, k, v with optional float32 (B, Hkv) descales, forward only (out
    bfloat16; docs/hopper.md, fp8)."""
    check_flags(deterministic=deterministic)
    window = None if window_size is None else [int(side) for side in window_size]
    expressions = op_values(score_mod, mask_mod, mod_inputs, block_mask, torch.Tensor)
    out, lse = torch.ops.kernelgen.attention(
        q, k, v, mask, bool(causal), scale, layout, seqlens_k, num_splits,
        window, softcap, alibi_slopes, sinks, bool(deterministic), q_descale, k_descale,
        v_descale, *expressions,
    )  # fmt: skip
    return (out, lse) if return_lse else out
