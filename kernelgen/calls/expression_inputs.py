"""The user expressions of one ``attention()`` call (docs/expressions.md): ``score_mod``,
``mask_mod``, the ``mod_inputs`` arrays they read and a ``block_mask`` of the mask_mod, checked
on metadata before anything is compiled or launched; and what the kernels get from them (spec
fields, the arrays' pointers, shapes and strides, the block mask's lists).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from kernelgen.calls.block_mask import BlockMask, element_strides, is_array
from kernelgen.errors import InputError, InputTypeError, SpecError
from kernelgen.kernels.expression_cuda import pointer_param, shape_param, stride_param
from kernelgen.runtime.frameworks import Arrays, launch_arg, module_of
from kernelgen.specs.expressions import (
    Expression,
    ExpressionKind,
    ModInput,
    checked_expression,
    inputs_from_arrays,
)
from kernelgen.specs.forward import KernelSpec, spec_from_dict

__all__ = ["CallExpressions", "check_expressions", "check_spec_expressions", "with_expressions"]

BLOCK_MASK_ARRAYS = {  # kernel parameter -> BlockMask field
    "block_partial_counts": "partial_counts",
    "block_partial_indices": "partial_indices",
    "block_full_counts": "full_counts",
    "block_full_indices": "full_indices",
}


@dataclass(frozen=True)
class CallExpressions:
    """A call's checked expressions: ``arrays`` maps each declared input's name to its array;
    ``block_mask`` (with its mask_mod the call's) makes the kernel block-sparse."""

    score_mod: Expression | None = None
    mask_mod: Expression | None = None
    inputs: tuple[ModInput, ...] = ()
    arrays: Mapping[str, Any] = field(default_factory=dict)
    block_mask: BlockMask | None = None

    @property
    def present(self) -> bool:
        return self.score_mod is not None or self.mask_mod is not None

    def spec_fields(self) -> dict[str, Any]:
        """The spec fields a kernel for this call is compiled with."""
        if not self.present:
            return {}
        return {
            "score_mod": None if self.score_mod is None else self.score_mod.text,
            "mask_mod": None if self.mask_mod is None else self.mask_mod.text,
            "mod_inputs": tuple(i.signature for i in self.inputs),
            "block_sparse": self.block_mask is not None,
        }

    def scalars(self) -> tuple[tuple[str, int], ...]:
        """The kernel's integer arguments by parameter name: each input's shape and element
        strides, and the block mask's (batch, heads) strides in query-tile rows."""
        values: list[tuple[str, int]] = []
        for spec in self.inputs:
            array = self.arrays[spec.name]
            values += [(shape_param(spec.name, d), int(n)) for d, n in enumerate(array.shape)]
            values += [
                (stride_param(spec.name, d), int(s)) for d, s in enumerate(element_strides(array))
            ]
        mask = self.block_mask
        if mask is not None:
            heads_rows = mask.q_tiles * mask.heads
            values.append(("block_mask_stride_b", heads_rows if mask.batch > 1 else 0))
            values.append(("block_mask_stride_h", mask.q_tiles if mask.heads > 1 else 0))
        return tuple(values)

    def named_arrays(self) -> dict[str, Any]:
        """Every array the call passes the kernels, by the name errors give it (the device
        check: they must all live with q)."""
        named = {f"mod_inputs[{name!r}]": array for name, array in self.arrays.items()}
        if self.block_mask is not None:
            named["block_mask"] = self.block_mask.partial_counts
        return named

    def tensors(self, arrays: Arrays) -> dict[str, Any]:
        """The kernel's array arguments by parameter name, in ``arrays``' library."""
        tensors = {pointer_param(name): launch_arg(arrays, a) for name, a in self.arrays.items()}
        if self.block_mask is not None:
            for param, name in BLOCK_MASK_ARRAYS.items():
                tensors[param] = launch_arg(arrays, getattr(self.block_mask, name))
        return tensors


KERNEL_DEVICE_TYPES = ("cpu", "cuda")  # where a torch tensor's memory can be read


def _check_array(name: str, array: Any) -> None:
    """A mod input must be an array the kernels can read: NumPy, CuPy, or a CPU or CUDA torch
    tensor (not a meta, MPS, ... one)."""
    if not is_array(array):
        raise InputTypeError(
            f"mod_inputs[{name!r}] is {type(array).__name__}; pass a NumPy, CuPy or torch array"
        )
    device = getattr(array, "device", None)
    if module_of(array) == "torch" and getattr(device, "type", None) not in KERNEL_DEVICE_TYPES:
        raise InputTypeError(
            f"mod_inputs[{name!r}] is a torch tensor on device {device}; pass it on the CPU or "
            "on q's CUDA device"
        )


def _checked(kind: ExpressionKind, value: Any, declared: tuple[ModInput, ...]) -> Expression:
    if not isinstance(value, (str, Expression)):
        raise InputTypeError(
            f"{kind} has type {type(value).__name__}; pass a string expression "
            "(docs/expressions.md) or None"
        )
    return checked_expression(kind, value, declared)


def check_expressions(
    *,
    score_mod: Any,
    mask_mod: Any,
    mod_inputs: Any,
    block_mask: Any,
    batch: int,
    heads: int,
    seqlen_q: int,
    seqlen_k: int,
) -> CallExpressions:
    """The call's expressions, checked: each parses against ``mod_inputs`` (name -> array,
    dtype and rank declare it), every array is one the kernels can read, and a block mask was
    built for this mask_mod and these sizes (its mask_mod serves when mask_mod is None)."""
    if block_mask is not None and not isinstance(block_mask, BlockMask):
        raise InputTypeError(
            f"block_mask has type {type(block_mask).__name__}; pass the result of "
            "kernelgen.block_mask(...)"
        )
    if mask_mod is None and block_mask is not None:
        mask_mod = block_mask.mask_mod
    if score_mod is None and mask_mod is None:
        if mod_inputs:
            raise InputError(
                "mod_inputs were given without a score_mod or mask_mod; pass the expressions "
                "that read them"
            )
        return CallExpressions()
    declared = inputs_from_arrays(mod_inputs)
    arrays = dict(mod_inputs or {})
    for name, array in arrays.items():
        _check_array(name, array)
    if block_mask is not None and block_mask.mask_mod.inputs != declared:
        raise InputError(
            f"block_mask's mask_mod was checked against mod inputs "
            f"{block_mask.mask_mod.signature or 'none'} but the call's mod_inputs are "
            f"{','.join(i.signature for i in declared) or 'none'}; build the block mask with the "
            "mod_inputs the call passes (kernelgen.block_mask(..., mod_inputs=<the same dict>))"
        )
    try:
        score = None if score_mod is None else _checked("score_mod", score_mod, declared)
        mask = None if mask_mod is None else _checked("mask_mod", mask_mod, declared)
    except SpecError as exc:  # a malformed expression is a bad argument of this call
        raise InputError("; ".join(exc.problems)) from None
    if block_mask is not None:
        if mask is None or block_mask.mask_mod.hash != mask.hash:
            raise InputError(
                f"block_mask was built for mask_mod {block_mask.mask_mod.text!r} "
                f"(inputs {block_mask.mask_mod.signature or 'none'}), not the call's "
                f"{mask.text if mask else None!r}; build it from the same mask_mod"
            )
        block_mask.check_fits(
            batch, heads, seqlen_q, seqlen_k, block_mask.block_m, block_mask.block_n
        )
    ordered = {i.name: arrays[i.name] for i in declared}
    return CallExpressions(score, mask, declared, ordered, block_mask)


def check_spec_expressions(
    spec: KernelSpec, expressions: CallExpressions, *, sparsity_given: bool = True
) -> None:
    """A user-given spec must be compiled with the call's expressions (and, with
    ``sparsity_given``, be block-sparse exactly when the call has a block mask, of the spec's
    tile shape; the backward builds lists for its own tiles and chooses)."""
    wanted = expressions.spec_fields()
    if not sparsity_given:
        wanted.pop("block_sparse", None)
        expressions = replace(expressions, block_mask=None)
    have = {name: getattr(spec, name) for name in wanted}
    if not expressions.present and spec.has_expressions:
        raise InputError(
            f"spec {spec.uri} is compiled with user expressions (score_mod={spec.score_mod!r}, "
            f"mask_mod={spec.mask_mod!r}) but the call passes none"
        )
    if have != wanted:
        differ = [f"{n}={wanted[n]!r} (spec: {have[n]!r})" for n in wanted if have[n] != wanted[n]]
        raise InputError(f"spec {spec.uri} does not match the call's {'; '.join(differ)}")
    mask = expressions.block_mask
    if mask is not None and (mask.block_m, mask.block_n) != (spec.block_m, spec.block_n):
        raise InputError(
            f"block_mask has {mask.block_m} x {mask.block_n} tiles but spec {spec.uri} has "
            f"block_m={spec.block_m}, block_n={spec.block_n}; build the mask with the spec's"
        )


def with_expressions(spec: KernelSpec, expressions: CallExpressions) -> KernelSpec:
    """``spec`` (a default or tuned choice) compiled with the call's expressions; with a block
    mask, of its tile shape (mma.sync: 4 warps, or one per 16 rows of smaller tiles; wgmma:
    the warpgroups of block_m), without split-KV or packed GQA."""
    if not expressions.present:
        return spec
    mask = expressions.block_mask
    tiles = None if mask is None else (mask.block_m, mask.block_n)
    return _spec_with(spec, tuple(expressions.spec_fields().items()), tiles)


@functools.lru_cache(maxsize=256)
def _spec_with(
    spec: KernelSpec, fields: tuple[tuple[str, Any], ...], tiles: tuple[int, int] | None
) -> KernelSpec:
    """with_expressions' spec, validated once per (spec, expression fields, block-mask tiles):
    calls with expressions take this path every time."""
    data = {**spec.model_dump(), **dict(fields)}
    if tiles is not None:
        if not spec.engine.block_sparse:
            raise InputError(
                f"block_mask needs a tensor-core (mma_sync or wgmma) kernel: float16/bfloat16 "
                f"inputs with 16-byte aligned rows; this call runs {spec.uri}"
            )
        data.update(block_m=tiles[0], block_n=tiles[1], pack_gqa=False, split_kv=False)
        if spec.engine.warp_specialized:
            del data["num_warps"]  # the producer and one consumer warpgroup per 64 rows
        else:
            data["num_warps"] = min(4, tiles[0] // 16)
    try:
        return spec_from_dict(data)
    except SpecError as exc:
        raise InputError(
            f"no kernel with the call's expressions fits ({'; '.join(exc.problems)})"
            + (
                f"; build the block mask with other tiles than {tiles[0]} x {tiles[1]}"
                if tiles is not None
                else ""
            )
        ) from None
