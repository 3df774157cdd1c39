"""The built-in attention variants of one call (docs/variants.md): argument checks and what the
kernels get from them (spec flags, run-time scalars, the slope and sink arrays).

Checks run on metadata only, before anything is compiled or launched; each bad argument raises a
typed error naming it, its value and what is allowed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Protocol

from kernelgen.errors import InputError, InputTypeError
from kernelgen.spec import VARIANT_FLAGS, KernelSpec

__all__ = ["CallVariants", "check_spec_variants", "check_variants"]


class ArrayInfo(Protocol):
    """What the checks read of an array (kernelgen.api.TensorInfo)."""

    name: str
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    dtype: str
    source: Any


@dataclass(frozen=True)
class CallVariants:
    """A call's checked variants. ``window`` is (left, right) with -1 unbounded, causal already
    applied (causal narrows right to 0), or None without a window; ``softcap`` None without a
    cap; ``alibi`` (fp32, (H,) or (B, H)) and ``sinks`` (fp32, (H,)) array metadata or None."""

    window: tuple[int, int] | None = None
    softcap: float | None = None
    alibi: ArrayInfo | None = None
    sinks: ArrayInfo | None = None

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

    def key(self) -> tuple[Any, ...]:
        """The scalars and array signatures a call plan depends on (arrays by shape/strides)."""
        arrays = tuple(
            None if a is None else (a.shape, a.strides, a.dtype) for a in (self.alibi, self.sinks)
        )
        return (self.window, self.softcap, *arrays)


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
    *,
    window_size: Any,
    softcap: Any,
    alibi_slopes: ArrayInfo | None,
    sinks: ArrayInfo | None,
    causal: bool,
    batch: int,
    heads: int,
) -> CallVariants:
    """The call's variants, checked: window_size (left, right) integers >= -1, softcap a finite
    number > 0, alibi_slopes float32 (H,) or (B, H), sinks float32 (H,)."""
    return CallVariants(
        window=_check_window(window_size, causal),
        softcap=_check_softcap(softcap),
        alibi=_check_array(alibi_slopes, [(heads,), (batch, heads)]),
        sinks=_check_array(sinks, [(heads,)]),
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
