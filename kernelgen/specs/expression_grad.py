"""The derivative of a checked ``score_mod`` with respect to ``score`` (docs/expressions.md,
"Gradients"): what the backward pass multiplies the gradient of the modified score by.

The rules rewrite the typed tree (:class:`kernelgen.specs.expressions.Node`) into another checked
``score_mod`` over the same declared inputs. A part that does not depend on ``score`` (ints,
input reads, literals, the index names) has derivative 0; products and sums with a literal 0 or
1 are simplified, nothing else, so the result reads like the chain rule written by hand and its
canonical text is a function of the input's. Kinks follow the evaluation: ``where`` and
``min``/``max`` take the derivative of the branch or argument they select (the first one at a
tie), ``abs`` has derivative 0 at 0. Floor division and modulo of a value that varies with
``score`` have no useful derivative and are refused with an InputError.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from kernelgen.errors import InputError, SpecError
from kernelgen.specs.expressions import (
    FLOAT_CONVERSION,
    SCORE_NAME,
    Expression,
    Node,
    ValueType,
    canonical_text,
    derived_expression,
)

ZERO = Node("const", "float", value=0.0)
ONE = Node("const", "float", value=1.0)
TWO = Node("const", "float", value=2.0)
EXACT_FLOAT_INT = 2**24  # an int literal up to this magnitude is the same value as a float
# min/max select a later argument only when it is strictly smaller / greater (the evaluator's
# and the emitter's fold): the derivative selects the same one.
_TAKES_LATER = {"min": "<", "max": ">"}
_REFUSED = {
    "//": "floor division of a value that varies with score is a step function",
    "%": "modulo of a value that varies with score jumps at every multiple of the divisor",
}


def _cut(text: str, limit: int = 60) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _binary(op: str, left: Node, right: Node) -> Node:
    """``left op right`` (not ``**``) typed as the checker types it."""
    both_int = left.type == right.type == "int" and op != "/"
    return Node("binary", "int" if both_int else "float", op=op, args=(left, right))


def _square(x: Node) -> Node:
    return Node("binary", x.type, op="**", args=(x, Node("const", "int", value=2)))


def _neg(x: Node) -> Node:
    if x == ZERO:
        return ZERO
    if x.kind == "neg":
        return x.args[0]
    return Node("neg", x.type, args=(x,))


def _unneg(x: Node) -> Node:
    return x.args[0] if x.kind == "neg" else x


def _plus(x: Node, y: Node) -> Node:
    if x == ZERO:
        return y
    if y == ZERO:
        return x
    return _minus(x, y.args[0]) if y.kind == "neg" else _binary("+", x, y)


def _minus(x: Node, y: Node) -> Node:
    if y == ZERO:
        return x
    if x == ZERO:
        return _neg(y)
    return _plus(x, y.args[0]) if y.kind == "neg" else _binary("-", x, y)


def _times(x: Node, y: Node) -> Node:
    """``x * y`` with 0 and 1 folded and a negation moved out (``x * -y`` is ``-(x * y)``); a
    float result stays a float (``1.0 * h`` keeps its 1.0 unless ``h`` is a literal exact in
    fp32, which becomes a float literal)."""
    if ZERO in (x, y):
        return ZERO
    if x.kind == "neg" or y.kind == "neg":
        product = _times(_unneg(x), _unneg(y))
        return product if (x.kind == "neg") == (y.kind == "neg") else _neg(product)
    for one, other in ((x, y), (y, x)):
        if one == ONE:
            if other.type == "float":
                return other
            if other.kind == "const" and other.value <= EXACT_FLOAT_INT:  # type: ignore[operator]
                return Node("const", "float", value=float(other.value))  # type: ignore[arg-type]
    return _binary("*", x, y)


def _over(x: Node, y: Node) -> Node:
    if x == ZERO:
        return ZERO
    return x if y == ONE else _binary("/", x, y)


def _where(condition: Node, then: Node, other: Node) -> Node:
    if then == other:
        return then
    return Node("call", "float", op="where", args=(condition, then, other))


def _compare(op: str, left: Node, right: Node) -> Node:
    return Node("compare", "bool", args=(left, right), value=(op,))


def _numeric_type(args: tuple[Node, ...]) -> ValueType:
    return "int" if all(a.type == "int" for a in args) else "float"


class _Derivative:
    """d/d(score) of the nodes of one score_mod (memoised by node identity)."""

    def __init__(self, expression: Expression) -> None:
        self.text = expression.text
        self.depending: dict[int, bool] = {}

    def depends(self, node: Node) -> bool:
        """Whether ``node`` reads ``score``."""
        known = self.depending.get(id(node))
        if known is None:
            known = (node.kind == "name" and node.op == SCORE_NAME) or any(
                [self.depends(a) for a in node.args]
            )
            self.depending[id(node)] = known
        return known

    def refuse(self, node: Node, why: str) -> InputError:
        return InputError(
            f"score_mod {_cut(self.text)!r}: its derivative with respect to score (needed by "
            f"the backward pass) is not defined at {_cut(canonical_text(node))!r}: {why}"
        )

    def of(self, node: Node) -> Node:
        """The derivative of ``node``, a float node: 0.0 where ``node`` does not read score or
        is an int (piecewise constant: it may read score only in a where's condition)."""
        if node.type != "float" or not self.depends(node):
            return ZERO
        if node.kind == "name":  # score itself
            return ONE
        if node.kind == "neg":
            return _neg(self.of(node.args[0]))
        if node.kind == "binary":
            return self.binary(node)
        if node.kind == "call" and node.op in _CALL_RULES:
            return _CALL_RULES[node.op](self, node)
        # unreachable: booleans only reach arithmetic through where's condition
        raise self.refuse(node, f"a {node.kind} node has no derivative")

    def binary(self, node: Node) -> Node:
        op = node.op
        a, b = node.args
        da = self.of(a)
        if op == "**":  # a ** 2
            return _times(_times(TWO, a), da)
        db = self.of(b)
        if op in _REFUSED:  # piecewise constant operands (score only in conditions) give 0
            if da == db == ZERO:
                return ZERO
            raise self.refuse(node, f"{_REFUSED[op]}; write the score_mod without {op}")
        if op == "+":
            return _plus(da, db)
        if op == "-":
            return _minus(da, db)
        if op == "*":
            return _plus(_times(da, b), _times(a, db))
        if db == ZERO:  # "/"
            return _over(da, b)
        return _over(_minus(da, _times(_over(a, b), db)), b)  # (a' - a / b * b') / b

    def where(self, node: Node) -> Node:
        condition, then, other = node.args
        return _where(condition, self.of(then), self.of(other))

    def min_max(self, node: Node) -> Node:
        """The fold of the evaluator: a later argument is selected when it is strictly smaller
        (greater) than the min (max) of those before it; ties keep the earlier one."""
        args = node.args
        selected = self.of(args[0])
        for k in range(1, len(args)):
            before = args[0] if k == 1 else Node("call", _numeric_type(args[:k]), node.op, args[:k])
            takes = _compare(_TAKES_LATER[node.op], args[k], before)
            selected = _where(takes, self.of(args[k]), selected)
        return selected

    def abs(self, node: Node) -> Node:
        """sign(a) * a', with sign(0) = 0."""
        (a,) = node.args
        da = self.of(a)
        negative = _where(_compare("<", a, ZERO), _neg(da), ZERO)
        return _where(_compare(">", a, ZERO), da, negative)

    def exp(self, node: Node) -> Node:
        return _times(node, self.of(node.args[0]))

    def log(self, node: Node) -> Node:
        (a,) = node.args
        return _over(self.of(a), a)

    def sqrt(self, node: Node) -> Node:
        return _over(self.of(node.args[0]), _times(TWO, node))

    def tanh(self, node: Node) -> Node:
        return _times(_minus(ONE, _square(node)), self.of(node.args[0]))


_CALL_RULES: dict[str, Callable[[_Derivative, Node], Node]] = {
    FLOAT_CONVERSION: lambda self, node: self.of(node.args[0]),  # an int score_mod's: 0.0
    "where": _Derivative.where,
    "min": _Derivative.min_max,
    "max": _Derivative.min_max,
    "abs": _Derivative.abs,
    "exp": _Derivative.exp,
    "log": _Derivative.log,
    "sqrt": _Derivative.sqrt,
    "tanh": _Derivative.tanh,
}


def score_mod_derivative(expression: Expression) -> Expression:
    """d(score_mod)/d(score) as a checked score_mod over the same declared inputs. InputError
    where the derivative is not defined (``//`` or ``%`` of a value that varies with score) or
    would exceed the size of a checked tree."""
    if type(expression) is not Expression or expression.kind != "score_mod":
        what = getattr(expression, "kind", type(expression).__name__)
        raise InputError(f"only a checked score_mod has a derivative, not {_cut(str(what))}")
    root = _Derivative(expression).of(expression.root)
    try:
        return derived_expression("score_mod", root, expression.inputs)
    except SpecError as exc:
        raise InputError(
            f"score_mod {_cut(expression.text)!r}: its derivative with respect to score (needed "
            f"by the backward pass) is too large: {'; '.join(exc.problems)}; write a smaller "
            "score_mod"
        ) from None


def score_mod_grad_callable(
    expression: Expression, inputs: Mapping[str, Any] | None = None
) -> Callable[..., np.ndarray]:
    """The float64 derivative of a score_mod as ``(score, b, h, q_idx, kv_idx) -> array`` (the
    reference's hook signature, :mod:`kernelgen.references.expressions`); ``inputs`` are the
    declared arrays, checked now."""
    from kernelgen.references.expressions import check_input_arrays, evaluate

    derivative = score_mod_derivative(expression)
    arrays = check_input_arrays(derivative.inputs, inputs)

    def grad(score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> np.ndarray:
        return evaluate(
            derivative, score=score, b=b, h=h, q_idx=q_idx, kv_idx=kv_idx, inputs=arrays
        )

    return grad
