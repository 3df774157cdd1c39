"""The variants of one call as one value (docs/variants.md, docs/expressions.md): the arguments
as given (:class:`VariantArgs`), their checks (:func:`check_variants`) and the checked value
(:class:`CallVariants`) that the plan, the render parameters, the launch and the backward read
(spec flags, run-time scalars by kernel parameter, the slope and sink arrays, the expressions).

Checks run on metadata only, before anything is compiled or launched; each bad argument raises a
typed error naming it, its value and what is allowed.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any, Protocol

from kernelgen.calls.expression_inputs import CallExpressions, check_expressions
from kernelgen.errors import InputError, InputTypeError
from kernelgen.runtime.frameworks import Arrays, launch_arg
from kernelgen.specs.forward import VARIANT_FLAGS, KernelSpec

__all__ = [
    "EXPRESSION_ARGUMENTS",
    "NO_VARIANTS",
    "VARIANT_ARGUMENTS",
    "CallVariants",
    "VariantArgs",
    "check_spec_variants",
    "check_variants",
]

# Each built-in variant's spec flag (kernelgen.specs.forward.VARIANT_FLAGS) -> its argument of
# attention() and of VariantArgs; the user expressions' spec fields -> theirs.
VARIANT_ARGUMENTS = {
    "window": "window_size",
    "softcap": "softcap",
    "alibi": "alibi_slopes",
    "sinks": "sinks",
}
EXPRESSION_ARGUMENTS = {"score_mod": "score_mod", "mask_mod": "mask_mod"}
VARIANT_ARRAYS = ("alibi_slopes", "sinks")  # the built-in variants' array arguments


class ArrayInfo(Protocol):
    """What the checks read of an array (kernelgen.calls.attention.TensorInfo)."""

    name: str
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    dtype: str
    source: Any


@dataclass(frozen=True)
class VariantArgs:
    """A call's variant arguments as given, unchecked: the built-in variants' (window_size,
    softcap, alibi_slopes, sinks: arrays, or their ArrayInfo) and the user expressions'
    (score_mod, mask_mod, mod_inputs, block_mask). The public functions build it once from
    their keywords; :func:`check_variants` gives the checked :class:`CallVariants`."""

    window_size: Any = None
    softcap: Any = None
    alibi_slopes: Any = None
    sinks: Any = None
    score_mod: Any = None
    mask_mod: Any = None
    mod_inputs: Any = None
    block_mask: Any = None

    def keywords(self) -> dict[str, Any]:
        """Every field as the keyword arguments of attention() and attention_backward()."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def arrays(self) -> dict[str, Any]:
        """The built-in variants' arrays by argument name (None where not given)."""
        return {name: getattr(self, name) for name in VARIANT_ARRAYS}

    def key_scalars(self) -> tuple[Any, ...]:
        """The built-in variants' arguments but the arrays (a call plan's key holds these; the
        arrays by signature)."""
        return tuple(
            getattr(self, f.name)
            for f in fields(self)
            if f.name in VARIANT_ARGUMENTS.values() and f.name not in VARIANT_ARRAYS
        )

    @property
    def has_expressions(self) -> bool:
        """Whether any user-expression argument is given (such calls are checked every time)."""
        return any(
            x is not None for x in (self.score_mod, self.mask_mod, self.mod_inputs, self.block_mask)
        )


NO_VARIANTS = VariantArgs()  # a call without variants or expressions


@dataclass(frozen=True)
class CallVariants:
    """A call's checked variants. ``window`` is (left, right) with -1 unbounded, causal already
    applied (causal narrows right to 0), or None without a window; ``softcap`` None without a
    cap; ``alibi`` (fp32, (H,) or (B, H)) and ``sinks`` (fp32, (H,)) array metadata or None;
    ``expressions`` the checked user expressions and block mask."""

    window: tuple[int, int] | None = None
    softcap: float | None = None
    alibi: ArrayInfo | None = None
    sinks: ArrayInfo | None = None
    expressions: CallExpressions = field(default_factory=CallExpressions)

    @property
    def flags(self) -> tuple[str, ...]:
        """The spec flags a kernel for this call is compiled with (VARIANT_FLAGS order)."""
        present = {
            "window": self.window is not None,
            "softcap": self.softcap is not None,
            "alibi": self.alibi is not None,
            "sinks": self.sinks is not None,
        }
        return tuple(name for name in VARIANT_FLAGS if present[name])

    @property
    def alibi_stride_b(self) -> int:
        """Elements between two batch entries' slopes (0: one slope per head for every batch)."""
        if self.alibi is None or len(self.alibi.shape) == 1:
            return 0
        return self.alibi.strides[0]

    def scalars(self) -> tuple[tuple[str, int | float], ...]:
        """The built-in variants' scalar kernel arguments by parameter name
        (kernelgen.kernels.render.VARIANT_PARAMS); an absent one gets render.VARIANT_OFF at
        launch."""
        values: list[tuple[str, int | float]] = []
        if self.window is not None:
            values += [("window_left", self.window[0]), ("window_right", self.window[1])]
        if self.softcap is not None:
            values.append(("softcap", self.softcap))
        if self.alibi is not None:
            values.append(("alibi_stride_b", self.alibi_stride_b))
        return tuple(values)

    def tensors(self, arrays: Arrays) -> dict[str, Any]:
        """The built-in variants' array arguments by parameter name, in ``arrays``' library (the
        expressions' are ``expressions.tensors``)."""
        return {
            info.name: launch_arg(arrays, info.source)
            for info in (self.alibi, self.sinks)
            if info is not None
        }


def _check_window(window_size: Any, causal: bool) -> tuple[int, int] | None:
    if window_size is None:
        return None
    try:
        left, right = window_size
    except (TypeError, ValueError):
        raise InputError(
            f"window_size={window_size!r} is not allowed; use a pair (left, right) of integers "
            ">= -1 (-1: unbounded)"
        ) from None
    for side, value in (("left", left), ("right", right)):
        if isinstance(value, bool) or not (isinstance(value, int) or _is_integer(value)):
            raise InputTypeError(
                f"window_size={window_size!r}: {side} has type {type(value).__name__}; use an "
                "integer >= -1 (-1: unbounded)"
            )
        if int(value) < -1:
            raise InputError(
                f"window_size={window_size!r}: {side}={int(value)} is not allowed; use an "
                "integer >= -1 (-1: unbounded)"
            )
    left, right = int(left), int(right)
    if causal and left < 0:
        return None  # (-1, anything) within causal is causal itself: the plain causal kernel
    if causal:  # causal is the window (-1, 0): the intersection narrows right to 0
        right = 0 if right < 0 else min(right, 0)
    if (left, right) == (-1, -1):
        return None  # no bound at all: the plain kernel
    return left, right


def _is_integer(value: Any) -> bool:
    numpy_value = type(value).__module__ == "numpy" and hasattr(value, "dtype")
    return numpy_value and value.dtype.kind in "iu"


def _check_softcap(softcap: Any) -> float | None:
    if softcap is None:
        return None
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)):
        raise InputTypeError(
            f"softcap has type {type(softcap).__name__}; use a number > 0 (or None: no cap)"
        )
    if not (math.isfinite(softcap) and softcap > 0):
        raise InputError(f"softcap={softcap!r} is not allowed; use a finite number > 0")
    return float(softcap)


def _check_array(info: ArrayInfo | None, shapes: list[tuple[int, ...]]) -> ArrayInfo | None:
    if info is None:
        return None
    allowed = " or ".join(str(s) for s in shapes)
    if info.dtype != "float32":
        raise InputTypeError(f"{info.name} has dtype {info.dtype}; expected float32")
    if tuple(info.shape) not in shapes:
        raise InputError(f"{info.name} has shape {tuple(info.shape)}; expected {allowed}")
    if info.strides[-1] != 1:
        raise InputError(
            f"{info.name} has stride {info.strides[-1]} along heads; expected 1 (a contiguous "
            "array)"
        )
    return info


def check_variants(
    args: VariantArgs,
    *,
    describe: Callable[[Any, str], ArrayInfo],
    causal: bool,
    batch: int,
    heads: int,
    seqlen_q: int,
    seqlen_k: int,
) -> CallVariants:
    """The call's variants, checked: window_size (left, right) integers >= -1, softcap a finite
    number > 0, alibi_slopes float32 (H,) or (B, H), sinks float32 (H,) (arrays read through
    ``describe(array, name)``), and the expressions (:func:`check_expressions`)."""
    if not isinstance(args, VariantArgs):
        raise InputTypeError(f"variants has type {type(args).__name__}; expected a VariantArgs")
    infos = {n: None if x is None else describe(x, n) for n, x in args.arrays().items()}
    return CallVariants(
        window=_check_window(args.window_size, causal),
        softcap=_check_softcap(args.softcap),
        alibi=_check_array(infos["alibi_slopes"], [(heads,), (batch, heads)]),
        sinks=_check_array(infos["sinks"], [(heads,)]),
        expressions=check_expressions(
            score_mod=args.score_mod,
            mask_mod=args.mask_mod,
            mod_inputs=args.mod_inputs,
            block_mask=args.block_mask,
            batch=batch,
            heads=heads,
            seqlen_q=seqlen_q,
            seqlen_k=seqlen_k,
        ),
    )


def check_spec_variants(spec: KernelSpec, variants: CallVariants) -> None:
    """A user-given spec must be compiled with the call's variants; a window kernel also serves
    calls without a window (it runs with (-1, -1), unbounded), the others need their values."""
    wanted = variants.flags
    if spec.variants == wanted or (spec.window and spec.variants == ("window", *wanted)):
        return
    have = ", ".join(spec.variants) or "none"
    need = ", ".join(wanted) or "none"
    raise InputError(
        f"spec {spec.uri} is compiled with variants [{have}] but the call needs [{need}]; set "
        f"{', '.join(f'{name}: true' for name in wanted) or 'no variant flags'} in the spec "
        "(and false for the others)"
    )
