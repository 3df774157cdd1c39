"""The user expressions and block mask of the torch operators (:mod:`kernelgen.torch_ops`) as
values an operator schema holds, and back (docs/expressions.md, "Through the torch operator").

A ``torch.library`` schema takes tensors, lists of tensors, ints, floats, bools and strings, but
no dict, no list of strings and no Python object; so :func:`kernelgen.attention`'s keywords
travel as eight arguments (:data:`OP_ARGUMENTS`, appended last to both operators' schemas):

- ``score_mod``, ``mask_mod``: ``str?``, the expression's text (a checked Expression: its
  canonical text, checked again against the call's mod_inputs);
- ``mod_inputs``: ``Tensor[]?``, the arrays, and ``mod_input_names``: ``str?``, their names
  joined by commas (names are identifiers, so the join is unambiguous);
- a BlockMask as ``block_mask``: ``Tensor[]?``, its four lists (partial_counts,
  partial_indices, full_counts, full_indices); ``block_mask_sizes``: ``SymInt[]?``, its
  (seqlen_q, seqlen_k, block_m, block_n) (batch and heads are the lists' shape);
  ``block_mask_mod``: ``str?``, its mask_mod's text; ``block_mask_inputs``: ``str?``, the mod
  inputs that mask_mod was checked against (``Expression.signature``: ``doc:int32[2],...``).

:func:`op_values` (the Python wrapper's side) only reads attributes, so that torch.compile traces
it without a graph break; :func:`call_keywords` (inside the operator and its fake) rebuilds
kernelgen.attention's keywords, and kernelgen's own checks (kernelgen.calls.expression_inputs,
``BlockMask.check_arrays``) then run on them.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

from kernelgen.calls.block_mask import OUTPUTS, BlockMask
from kernelgen.errors import InputError, InputTypeError, SpecError
from kernelgen.specs.expressions import (
    Expression,
    checked_expression,
    declare_inputs,
    parse_input_signature,
)

__all__ = ["OP_ARGUMENTS", "call_keywords", "join_tensors", "op_values", "split_tensors"]

OP_ARGUMENTS = (
    "score_mod", "mask_mod", "mod_inputs", "mod_input_names", "block_mask", "block_mask_sizes",
    "block_mask_mod", "block_mask_inputs",
)  # fmt: skip
SIZE_NAMES = ("seqlen_q", "seqlen_k", "block_m", "block_n")  # block_mask_sizes, in order
NAME_SEPARATOR = ","  # between mod_input_names (and block_mask_inputs' signatures)
# The operators' BlockMasks by their pieces, so that a training loop that passes the same lists
# each step gets the same BlockMask back, and the backward reuses the lists it derived from them
# (BlockMask.derived: the key tiles' query-tile lists) instead of building them every step. A
# list's key is its address, geometry and version counter (bumped by every in-place write): an
# entry holds its tensors, so no other tensor takes their address while it is kept.
BLOCK_MASK_CACHE_SIZE = 16
_BLOCK_MASKS: OrderedDict[tuple[Any, ...], BlockMask] = OrderedDict()


def _text(name: str, value: Any) -> str | None:
    """An expression argument as text: a string, or a checked Expression's canonical text."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, Expression):
        return value.text
    raise InputTypeError(
        f"{name} has type {type(value).__name__}; pass a string expression "
        "(docs/expressions.md) or None"
    )


def _tensor(label: str, value: Any, tensor_type: type) -> Any:
    if not isinstance(value, tensor_type):
        raise InputTypeError(
            f"{label} is a {type(value).__name__}; torch.ops.kernelgen.attention takes torch "
            "tensors (of q's device)"
        )
    return value


def op_values(
    score_mod: Any, mask_mod: Any, mod_inputs: Any, block_mask: Any, tensor_type: type
) -> tuple[Any, ...]:
    """kernelgen.attention's ``score_mod``, ``mask_mod``, ``mod_inputs`` and ``block_mask`` as
    the operators' :data:`OP_ARGUMENTS` values, in order. Arrays must be ``tensor_type``
    (torch.Tensor); type errors name the argument."""
    tensors = names = None
    if mod_inputs is not None:
        if not isinstance(mod_inputs, Mapping):
            raise InputTypeError(
                f"mod_inputs is {type(mod_inputs).__name__}; pass a dict of name -> array"
            )
        for name in mod_inputs:
            if not isinstance(name, str) or NAME_SEPARATOR in name:
                raise InputError(
                    f"mod_inputs: mod input name {name!r} is not allowed; use an ASCII "
                    "identifier (docs/expressions.md)"
                )
        tensors = [_tensor(f"mod_inputs[{n!r}]", a, tensor_type) for n, a in mod_inputs.items()]
        names = NAME_SEPARATOR.join(mod_inputs)
    lists = sizes = mask_text = mask_inputs = None
    if block_mask is not None:
        if not isinstance(block_mask, BlockMask):
            raise InputTypeError(
                f"block_mask has type {type(block_mask).__name__}; pass the result of "
                "kernelgen.block_mask(...)"
            )
        lists = [_tensor(f"block_mask.{n}", getattr(block_mask, n), tensor_type) for n in OUTPUTS]
        sizes = [getattr(block_mask, n) for n in SIZE_NAMES]
        expression = block_mask.mask_mod
        if not isinstance(expression, Expression):
            raise InputTypeError(
                f"block_mask.mask_mod has type {type(expression).__name__}; expected a checked "
                "mask_mod (build block masks with kernelgen.block_mask)"
            )
        mask_text = expression.text
        mask_inputs = expression.signature  # name:dtype[rank], joined by commas
    return (
        _text("score_mod", score_mod), _text("mask_mod", mask_mod), tensors, names, lists, sizes,
        mask_text, mask_inputs,
    )  # fmt: skip


def _both_or_neither(pairs: Mapping[str, Any]) -> None:
    given = [name for name, value in pairs.items() if value is not None]
    if given and len(given) != len(pairs):
        missing = [name for name in pairs if name not in given]
        raise InputError(
            f"{', '.join(given)} given without {', '.join(missing)}; the operator takes them "
            "together (kernelgen.torch_ops.attention builds them)"
        )


def _mod_inputs(tensors: Sequence[Any] | None, names: str | None) -> dict[str, Any] | None:
    _both_or_neither({"mod_inputs": tensors, "mod_input_names": names})
    if tensors is None:
        return None
    split = names.split(NAME_SEPARATOR) if names else []
    if len(split) != len(tensors):
        raise InputError(
            f"mod_input_names={names!r} names {len(split)} arrays but mod_inputs holds "
            f"{len(tensors)}; give one name per array, joined by {NAME_SEPARATOR!r}"
        )
    found: dict[str, Any] = {}
    for name, tensor in zip(split, tensors, strict=True):
        if name in found:
            raise InputError(f"mod_input_names={names!r} names {name!r} twice; names are unique")
        found[name] = tensor
    return found


def _block_mask(
    lists: Sequence[Any] | None,
    sizes: Sequence[int] | None,
    mask_text: str | None,
    mask_inputs: str | None,
) -> BlockMask | None:
    pieces = {"block_mask": lists, "block_mask_sizes": sizes, "block_mask_mod": mask_text,
              "block_mask_inputs": mask_inputs}  # fmt: skip
    _both_or_neither(pieces)
    if lists is None:
        return None
    for name, value, count, what in (
        ("block_mask", lists, len(OUTPUTS), ", ".join(OUTPUTS)),
        ("block_mask_sizes", sizes, len(SIZE_NAMES), ", ".join(SIZE_NAMES)),
    ):
        if len(value) != count:
            raise InputError(f"{name} holds {len(value)} values; expected {count}: {what}")
    try:
        signatures = mask_inputs.split(NAME_SEPARATOR) if mask_inputs else []
        declared = declare_inputs(parse_input_signature(s) for s in signatures)
    except SpecError as exc:
        raise InputError(f"block_mask_inputs={mask_inputs!r}: {'; '.join(exc.problems)}") from None
    try:
        expression = checked_expression("mask_mod", mask_text, declared)
    except SpecError as exc:
        raise InputError(f"block_mask_mod: {'; '.join(exc.problems)}") from None
    seqlen_q, seqlen_k, block_m, block_n = (int(n) for n in sizes)
    return BlockMask(expression, seqlen_q, seqlen_k, block_m, block_n, *lists)


def call_keywords(
    score_mod: str | None,
    mask_mod: str | None,
    mod_inputs: Sequence[Any] | None,
    mod_input_names: str | None,
    block_mask: Sequence[Any] | None,
    block_mask_sizes: Sequence[int] | None,
    block_mask_mod: str | None,
    block_mask_inputs: str | None,
    *,
    reuse: bool = False,
) -> dict[str, Any]:
    """The operators' :data:`OP_ARGUMENTS` values as kernelgen.attention's ``score_mod``,
    ``mask_mod``, ``mod_inputs`` (a dict) and ``block_mask`` (a BlockMask, its mask_mod
    checked against ``block_mask_inputs``); InputError names the argument that does not fit.
    The call's own checks of these keywords run where they are passed. ``reuse`` (the
    operators themselves, not their fakes): the BlockMask of earlier calls with the same
    pieces, where its lists are torch tensors unchanged since (:data:`BLOCK_MASK_CACHE_SIZE`
    kept)."""
    pieces = (block_mask, block_mask_sizes, block_mask_mod, block_mask_inputs)
    key = _block_mask_key(*pieces) if reuse else None
    mask = _BLOCK_MASKS.get(key) if key is not None else None
    if mask is None:
        mask = _block_mask(*pieces)
        if key is not None:
            _BLOCK_MASKS[key] = mask
            while len(_BLOCK_MASKS) > BLOCK_MASK_CACHE_SIZE:
                _BLOCK_MASKS.popitem(last=False)
    elif key is not None:
        _BLOCK_MASKS.move_to_end(key)
    return {
        "score_mod": score_mod,
        "mask_mod": mask_mod,
        "mod_inputs": _mod_inputs(mod_inputs, mod_input_names),
        "block_mask": mask,
    }


def _block_mask_key(
    lists: Sequence[Any] | None,
    sizes: Sequence[int] | None,
    mask_text: str | None,
    mask_inputs: str | None,
) -> tuple[Any, ...] | None:
    """:data:`_BLOCK_MASKS`' key of a block mask's pieces; None where there is no block mask,
    or its lists are no torch tensors with a version counter (inference tensors have none)."""
    if lists is None or sizes is None:
        return None
    try:
        arrays = tuple(
            (x.data_ptr(), tuple(x.shape), tuple(x.stride()), str(x.dtype), str(x.device),
             x._version)
            for x in lists
        )  # fmt: skip
    except (AttributeError, RuntimeError):
        return None
    return (mask_text, mask_inputs, tuple(int(n) for n in sizes), arrays)


def split_tensors(values: Mapping[str, Any]) -> tuple[list[Any], dict[str, int]]:
    """The tensors among ``values`` (:data:`OP_ARGUMENTS` by name: mod_inputs, then the block
    mask's lists) and their counts by argument, to save for the backward and rebuild with
    :func:`join_tensors`."""
    tensors: list[Any] = []
    counts = {}
    for name in ("mod_inputs", "block_mask"):
        listed = values[name]
        counts[name] = -1 if listed is None else len(listed)
        tensors += list(listed or ())
    return tensors, counts


def join_tensors(tensors: Sequence[Any], counts: Mapping[str, int]) -> dict[str, Any]:
    """:func:`split_tensors` undone: mod_inputs and block_mask as lists (or None)."""
    found: dict[str, Any] = {}
    start = 0
    for name in ("mod_inputs", "block_mask"):
        count = counts[name]
        found[name] = None if count < 0 else list(tensors[start : start + count])
        start += max(count, 0)
    return found
