"""The float64 NumPy evaluator of checked expressions (:mod:`kernelgen.specs.expressions`): the
reference the generated device functions are tested against.

Values follow the language's types (docs/expressions.md): int is int64, float is float64 here
(fp32 on the GPU), bool is bool. Operations broadcast over index grids, so one call evaluates an
expression for every (b, h, q_idx, kv_idx) of a problem.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from kernelgen.errors import InputError, InputTypeError
from kernelgen.specs.expressions import INPUT_DTYPES, Expression, ModInput, Node

Value = np.ndarray


def _as_type(value: Value, target: str) -> Value:
    return value.astype(np.float64) if target == "float" else value


def _numeric(node: Node, values: list[Value]) -> list[Value]:
    """Operands converted to the node's arithmetic type (int stays int64; float: float64)."""
    return [_as_type(v, node.type) for v in values]


def _floordiv(node: Node, x: Value, y: Value) -> Value:
    if node.type == "int":  # floor semantics; a zero divisor gives 0
        return np.where(y == 0, 0, np.floor_divide(x, np.where(y == 0, 1, y)))
    return np.floor(x / y)


def _mod(node: Node, x: Value, y: Value) -> Value:
    if node.type == "int":  # the sign of the divisor; a zero divisor gives 0
        return np.where(y == 0, 0, np.remainder(x, np.where(y == 0, 1, y)))
    return x - y * np.floor(x / y)


BINARY: dict[str, Callable[[Node, Value, Value], Value]] = {
    "+": lambda n, x, y: x + y,
    "-": lambda n, x, y: x - y,
    "*": lambda n, x, y: x * y,
    "/": lambda n, x, y: x / y,
    "//": _floordiv,
    "%": _mod,
    "**": lambda n, x, y: x * x,
}
COMPARE: dict[str, Callable[[Value, Value], Value]] = {
    "<": np.less,
    "<=": np.less_equal,
    ">": np.greater,
    ">=": np.greater_equal,
    "==": np.equal,
    "!=": np.not_equal,
}
# min/max as Python's: the first argument unless a later one is strictly smaller (greater)
CALLS: dict[str, Callable[..., Value]] = {
    "min": lambda x, y: np.where(y < x, y, x),
    "max": lambda x, y: np.where(y > x, y, x),
    "abs": np.abs,
    "exp": np.exp,
    "log": np.log,
    "tanh": np.tanh,
    "sqrt": np.sqrt,
    "float": lambda x: x,
}


class _Evaluator:
    def __init__(self, names: Mapping[str, Value], inputs: Mapping[str, Value]) -> None:
        self.names = names
        self.inputs = inputs

    def value(self, node: Node) -> Value:
        kind = node.kind
        if kind == "const":
            return np.asarray(node.value, dtype=np.int64 if node.type == "int" else np.float64)
        if kind == "name":
            return self.names[node.op]
        args = [self.value(a) for a in node.args]
        if kind == "read":
            return self.read(node, args)
        if kind == "neg":
            return -args[0]
        if kind == "not":
            return np.logical_not(args[0])
        if kind == "logic":
            combine = np.logical_and if node.op == "and" else np.logical_or
            result = args[0]
            for arg in args[1:]:
                result = combine(result, arg)
            return result
        if kind == "compare":
            result = np.asarray(True)
            for i, op in enumerate(node.value):  # type: ignore[arg-type]
                x, y = args[i], args[i + 1]
                if x.dtype != np.bool_:
                    common = (
                        "float" if "float" in (node.args[i].type, node.args[i + 1].type) else ""
                    )
                    x, y = _as_type(x, common), _as_type(y, common)
                result = np.logical_and(result, COMPARE[op](x, y))
            return result
        if kind == "binary":
            x, y = _numeric(node, args)
            return BINARY[node.op](node, x, y)
        if node.op == "where":
            condition, then, other = args
            if node.type != "bool":
                then, other = _as_type(then, node.type), _as_type(other, node.type)
            return np.where(condition, then, other)
        if node.op in ("min", "max"):
            args = _numeric(node, args)
            result = args[0]
            for arg in args[1:]:
                result = CALLS[node.op](result, arg)
            return result
        if node.op == "abs":
            return np.abs(args[0])
        return CALLS[node.op](args[0].astype(np.float64))

    def read(self, node: Node, indices: list[Value]) -> Value:
        """``input[indices]``; an index outside the array reads 0 (0.0, False)."""
        array = self.inputs[node.op]
        shape = np.broadcast_shapes(*(i.shape for i in indices))
        inside = np.ones(shape, dtype=bool)
        clipped = []
        for size, index in zip(array.shape, indices, strict=True):
            inside &= (index >= 0) & (index < size)
            clipped.append(np.clip(index, 0, max(size - 1, 0)))
        if array.size == 0:
            return np.zeros(shape, dtype=_READ_DTYPE[node.type])
        values = array[tuple(clipped)].astype(_READ_DTYPE[node.type])
        return np.where(inside, values, np.zeros((), dtype=values.dtype))


_READ_DTYPE = {"float": np.float64, "int": np.int64, "bool": np.bool_}


def check_input_arrays(
    declared: tuple[ModInput, ...], arrays: Mapping[str, Any] | None
) -> dict[str, np.ndarray]:
    """``arrays`` as NumPy arrays, checked against the declarations (every declared input
    present, nothing else, each of the declared rank and dtype)."""
    arrays = dict(arrays or {})
    names = {i.name for i in declared}
    missing = sorted(names - arrays.keys())
    extra = sorted(arrays.keys() - names)
    if missing or extra:
        raise InputError(
            f"mod_inputs names {sorted(arrays)}; the expression declares {sorted(names)}"
            + (f" (missing: {', '.join(missing)})" if missing else "")
            + (f" (not declared: {', '.join(extra)})" if extra else "")
        )
    checked = {}
    for spec in declared:
        array = np.asarray(arrays[spec.name])
        dtype = array.dtype.name
        if dtype != spec.dtype:
            raise InputTypeError(
                f"mod_inputs[{spec.name!r}] has dtype {dtype}; declared {spec.dtype} "
                f"(allowed: {', '.join(INPUT_DTYPES)})"
            )
        if array.ndim != spec.rank:
            raise InputError(
                f"mod_inputs[{spec.name!r}] has shape {array.shape}; declared rank {spec.rank}"
            )
        checked[spec.name] = array
    return checked


def evaluate(
    expression: Expression,
    *,
    b: Any,
    h: Any,
    q_idx: Any,
    kv_idx: Any,
    score: Any = None,
    inputs: Mapping[str, Any] | None = None,
) -> np.ndarray:
    """The expression's values over broadcast ``b, h, q_idx, kv_idx`` (integers or integer
    arrays) and ``score`` (score_mod: float64 values); ``inputs`` the declared arrays."""
    names = {
        "b": np.asarray(b, dtype=np.int64),
        "h": np.asarray(h, dtype=np.int64),
        "q_idx": np.asarray(q_idx, dtype=np.int64),
        "kv_idx": np.asarray(kv_idx, dtype=np.int64),
    }
    if expression.kind == "score_mod":
        if score is None:
            raise InputError("score_mod needs score= values to evaluate")
        names["score"] = np.asarray(score, dtype=np.float64)
    arrays = check_input_arrays(expression.inputs, inputs)
    with np.errstate(all="ignore"):
        result = _Evaluator(names, arrays).value(expression.root)
    shape = np.broadcast_shapes(*(v.shape for v in names.values()))
    return np.broadcast_to(result, np.broadcast_shapes(shape, result.shape))


def evaluate_grid(
    expression: Expression,
    batch: int,
    heads: int,
    seqlen_q: int,
    seqlen_k: int,
    *,
    score: Any = None,
    inputs: Mapping[str, Any] | None = None,
) -> np.ndarray:
    """The expression at every (b, h, q_idx, kv_idx) of a (batch, heads, seqlen_q, seqlen_k)
    problem, as a float64 (score_mod) or bool (mask_mod) array of that shape."""
    grid = np.ogrid[:batch, :heads, :seqlen_q, :seqlen_k]
    values = evaluate(
        expression, b=grid[0], h=grid[1], q_idx=grid[2], kv_idx=grid[3], score=score, inputs=inputs
    )
    return np.broadcast_to(values, (batch, heads, seqlen_q, seqlen_k))
