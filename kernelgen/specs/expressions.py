"""The safe expression language of ``score_mod`` and ``mask_mod`` (docs/expressions.md).

A user expression is parsed with Python's ``ast`` into a whitelist and type-checked into a small
typed tree (:class:`Node`). Nothing of the user's text survives but what this tree holds:
validated names, finite numbers and operators from fixed tables. The tree has one canonical
spelling (:attr:`Expression.text`) and a short stable hash of that spelling and the declared
inputs (:attr:`Expression.hash`), which names kernels and keys caches. The C++ emitter is
:mod:`kernelgen.kernels.expression_cuda`, the float64 NumPy evaluator
:mod:`kernelgen.references.expressions`, the derivative of a score_mod with respect to the score
:mod:`kernelgen.specs.expression_grad`.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import itertools
import keyword
import math
import re
import warnings
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from kernelgen.errors import InputError, InputTypeError, SpecError

ExpressionKind = Literal["score_mod", "mask_mod"]
ValueType = Literal["int", "float", "bool"]  # int: 64-bit signed; float: fp32 on the GPU

MAX_EXPRESSION_CHARS = 2000  # longer text is refused before it is parsed
MAX_DEPTH = 64  # nesting of the expression tree (a chain a + b + c ... nests once per term)
MAX_NODES = 500  # operators, names and literals together
MAX_RANK = 4  # dimensions of a declared input
MAX_INPUTS = 16
MAX_NAME_CHARS = 32
MAX_CALL_ARGS = 8  # min/max arguments
FLOAT32_MAX = 3.4028234663852886e38
INT64_MAX = 2**63 - 1
HASH_CHARS = 12
HASH_VERSION = "kernelgen-expression-1"

# Element types a declared input may have -> the value type its reads give.
INPUT_DTYPES: dict[str, ValueType] = {
    "float32": "float",
    "float16": "float",
    "bfloat16": "float",
    "int32": "int",
    "int64": "int",
    "bool": "bool",
}
# The index names every expression sees (64-bit ints) and the score (score_mod only).
INDEX_NAMES = ("b", "h", "q_idx", "kv_idx")
SCORE_NAME = "score"
# Functions: name -> (least, most arguments).
FUNCTIONS: dict[str, tuple[int, int]] = {
    "where": (3, 3),
    "min": (2, MAX_CALL_ARGS),
    "max": (2, MAX_CALL_ARGS),
    "abs": (1, 1),
    "exp": (1, 1),
    "log": (1, 1),
    "tanh": (1, 1),
    "sqrt": (1, 1),
}
FLOAT_FUNCTIONS = ("exp", "log", "tanh", "sqrt")  # always float results
BINARY_OPS: dict[type[ast.operator], str] = {
    ast.Add: "+",
    ast.Sub: "-",
    ast.Mult: "*",
    ast.Div: "/",
    ast.FloorDiv: "//",
    ast.Mod: "%",
    ast.Pow: "**",
}
COMPARE_OPS: dict[type[ast.cmpop], str] = {
    ast.Lt: "<",
    ast.LtE: "<=",
    ast.Gt: ">",
    ast.GtE: ">=",
    ast.Eq: "==",
    ast.NotEq: "!=",
}
ORDERED_COMPARISONS = ("<", "<=", ">", ">=")
LOGIC_OPS: dict[type[ast.boolop], str] = {ast.And: "and", ast.Or: "or"}
# Spellings of refused operators, for the error messages.
REFUSED_OPS: dict[type[ast.AST], str] = {
    ast.MatMult: "@",
    ast.BitAnd: "&",
    ast.BitOr: "|",
    ast.BitXor: "^",
    ast.LShift: "<<",
    ast.RShift: ">>",
    ast.Invert: "~",
    ast.UAdd: "unary +",
    ast.Is: "is",
    ast.IsNot: "is not",
    ast.In: "in",
    ast.NotIn: "not in",
}
# Constructs refused by name (anything else not handled is refused by its class name).
REFUSED_CONSTRUCTS: dict[type[ast.AST], str] = {
    ast.Attribute: "attribute access",
    ast.Lambda: "lambda",
    ast.NamedExpr: "assignment expression (:=)",
    ast.IfExp: "if-else expression (use where(c, x, y))",
    ast.ListComp: "comprehension",
    ast.SetComp: "comprehension",
    ast.DictComp: "comprehension",
    ast.GeneratorExp: "comprehension",
    ast.Starred: "starred argument",
    ast.JoinedStr: "f-string",
    ast.List: "list",
    ast.Tuple: "tuple",
    ast.Dict: "dict",
    ast.Set: "set",
    ast.Slice: "slice",
    ast.Await: "await",
    ast.Yield: "yield",
    ast.YieldFrom: "yield",
}
ALLOWED = (
    "allowed: score (score_mod only), b, h, q_idx, kv_idx, declared inputs indexed with their "
    "rank, int and float literals, + - * / // % **2, unary -, comparisons, and/or/not, "
    "where(c, x, y), min, max, abs, exp, log, tanh, sqrt"
)
# Precedence of the canonical spelling (higher binds tighter).
PRECEDENCE: dict[str, int] = {
    "or": 1,
    "and": 2,
    "not": 3,
    "compare": 4,
    "+": 5,
    "-": 5,
    "*": 6,
    "/": 6,
    "//": 6,
    "%": 6,
    "neg": 7,
    "**": 8,
    "atom": 9,
}
_NAME_RE = re.compile(r"[A-Za-z][A-Za-z0-9_]*\Z")
_PRINTABLE_RE = re.compile(r"[\x20-\x7e\t\n\r]*\Z")
RESERVED_INPUT_NAMES = frozenset((SCORE_NAME, *INDEX_NAMES, *FUNCTIONS))


def _cut(text: str, limit: int = 40) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


@dataclass(frozen=True)
class ModInput:
    """An extra array a ``score_mod`` or ``mask_mod`` reads: its name in the expression, its
    element type and its rank (the number of indices a read takes)."""

    name: str
    dtype: str
    rank: int

    def __post_init__(self) -> None:
        problems = []
        name = self.name
        if (
            not isinstance(name, str)
            or not _NAME_RE.match(name)
            or len(name) > MAX_NAME_CHARS
            or "__" in name  # reserved in C++ identifiers
        ):
            problems.append(
                f"mod input name {_cut(repr(name))} is not allowed; use an ASCII identifier of at "
                f"most {MAX_NAME_CHARS} characters starting with a letter, without '__'"
            )
        elif keyword.iskeyword(name) or name in RESERVED_INPUT_NAMES or name.startswith("kg_"):
            problems.append(
                f"mod input name {name!r} is reserved (Python keywords, kg_*, "
                f"{', '.join(sorted(RESERVED_INPUT_NAMES))}); choose another name"
            )
        if not isinstance(self.dtype, str) or self.dtype not in INPUT_DTYPES:
            problems.append(
                f"mod input {_cut(repr(name))}: dtype {_cut(repr(self.dtype))} is not allowed; "
                f"use one of {', '.join(INPUT_DTYPES)}"
            )
        rank = self.rank
        if type(rank) is not int or not 1 <= rank <= MAX_RANK:
            problems.append(
                f"mod input {_cut(repr(name))}: rank {_cut(repr(rank))} is not allowed; use an "
                f"integer from 1 to {MAX_RANK}"
            )
        if problems:
            raise SpecError(problems)

    @property
    def value_type(self) -> ValueType:
        return INPUT_DTYPES[self.dtype]

    @property
    def signature(self) -> str:
        return f"{self.name}:{self.dtype}[{self.rank}]"


def declare_inputs(inputs: Iterable[ModInput] | None) -> tuple[ModInput, ...]:
    """Declared inputs in canonical (name) order; duplicate names are a SpecError."""
    given = list(inputs or ())
    if not all(isinstance(i, ModInput) for i in given):
        raise SpecError(["mod inputs must be ModInput(name, dtype, rank) values"])
    declared = sorted(given, key=lambda i: i.name)
    problems = [
        f"mod input {a.name!r} is declared twice"
        for a, b in itertools.pairwise(declared)
        if a.name == b.name
    ]
    if len(declared) > MAX_INPUTS:
        problems.append(f"{len(declared)} mod inputs declared; at most {MAX_INPUTS} are allowed")
    if problems:
        raise SpecError(problems)
    return tuple(declared)


@dataclass(frozen=True)
class Node:
    """One node of a checked expression. ``kind`` is one of const (``value``), name (``op``:
    the name), read (``op``: the input's name, ``args``: the indices), neg, not, binary (``op``
    from BINARY_OPS; ``**`` only with the literal 2 on the right), compare (``value``: the
    operators of a chain, ``args``: the operands), logic (``op``: and/or), call (``op``: the
    function). ``type`` is the value type the node gives."""

    kind: str
    type: ValueType
    op: str = ""
    args: tuple[Node, ...] = ()
    value: int | float | tuple[str, ...] | None = None


_PARSER = object()  # parse_expression's mark on the trees it checked


@dataclass(frozen=True)
class Expression:
    """A checked ``score_mod`` or ``mask_mod``: its tree, canonical text, declared inputs and
    hash. Build with :func:`parse_score_mod` / :func:`parse_mask_mod` (a derivative: with
    :func:`derived_expression`); a tree built by hand is replaced by what its canonical text
    checks to (or refused), and every tree (a copy made with ``dataclasses.replace`` too) is
    verified (:func:`verify_tree`), so that the emitter, which verifies it again, only ever sees
    checked trees."""

    kind: ExpressionKind
    root: Node
    inputs: tuple[ModInput, ...]
    text: str = field(init=False)
    origin: object = field(default=None, repr=False, compare=False)
    # the inputs' signature, made once: torch.compile(dynamic=True) traces the operator's
    # wrapper reading it, and there an int attribute is symbolic and cannot be formatted
    _signature: str = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.origin is not _PARSER:  # built by hand: keep only what its text checks to
            _check_tree_size(self.kind, self.root)  # before printing it: a DAG could explode
            try:
                text = canonical_text(self.root)
            except (AttributeError, KeyError, TypeError, ValueError, IndexError, RecursionError):
                raise SpecError([f"{self.kind}: not a checked expression tree"]) from None
            checked = parse_expression(self.kind, text, self.inputs)
            object.__setattr__(self, "root", checked.root)
            object.__setattr__(self, "inputs", checked.inputs)
        # every tree, dataclasses.replace's copies of parsed ones included, is checked again
        verify_tree(self.kind, self.root, self.inputs)
        object.__setattr__(self, "text", canonical_text(self.root))
        object.__setattr__(self, "_signature", ",".join(i.signature for i in self.inputs))

    @property
    def signature(self) -> str:
        """The declared inputs, in name order: ``name:dtype[rank],...``."""
        return self._signature

    @property
    def hash(self) -> str:
        """12 hex digits of sha256 over the kind, canonical text and input signature: the same
        for every spelling of one expression (whitespace, parentheses, comments, literal
        forms, input order), different when its meaning or inputs differ."""
        key = f"{HASH_VERSION}\n{self.kind}\n{self.text}\n{self.signature}"
        return hashlib.sha256(key.encode()).hexdigest()[:HASH_CHARS]

    def uses(self, name: str) -> bool:
        """Whether the expression reads ``name`` (an index name, score or an input)."""
        return any(n.kind in ("name", "read") and n.op == name for n in walk(self.root))


def walk(node: Node) -> Iterable[Node]:
    """``node`` and every node under it, depth first."""
    yield node
    for arg in node.args:
        yield from walk(arg)


# --------------------------------------------------------------------------------------------
# Parsing and type checking
# --------------------------------------------------------------------------------------------


class _Checker:
    """Turns a Python AST into a typed :class:`Node` tree or raises a SpecError naming the
    offending token."""

    def __init__(self, kind: ExpressionKind, text: str, inputs: tuple[ModInput, ...]) -> None:
        self.kind = kind
        self.text = text
        self.inputs = {i.name: i for i in inputs}
        self.nodes = 0

    def fail(self, node: ast.AST | None, problem: str) -> SpecError:
        where = ""
        if node is not None and hasattr(node, "col_offset"):
            where = f" (line {node.lineno}, column {node.col_offset + 1})"
        return SpecError([f"{self.kind}: {problem}{where}"])

    def token(self, node: ast.AST) -> str:
        segment = ast.get_source_segment(self.text, node) or type(node).__name__
        return repr(_cut(" ".join(segment.split())))

    def refuse(self, node: ast.AST, what: str) -> SpecError:
        return self.fail(node, f"{what} {self.token(node)} is not allowed; {ALLOWED}")

    def check(self, node: ast.AST, depth: int = 0) -> Node:
        self.nodes += 1
        if depth > MAX_DEPTH:
            raise self.fail(node, f"the expression nests deeper than {MAX_DEPTH} levels")
        if self.nodes > MAX_NODES:
            raise self.fail(node, f"the expression has more than {MAX_NODES} parts")
        handler = _HANDLERS.get(type(node))
        if handler is None:
            what = REFUSED_CONSTRUCTS.get(type(node), type(node).__name__)
            raise self.refuse(node, what)
        return handler(self, node, depth + 1)

    # ---- leaves ----
    def constant(self, node: ast.Constant, depth: int) -> Node:
        value = node.value
        if type(value) is int:
            if value > INT64_MAX:
                raise self.fail(node, f"integer literal {self.token(node)} exceeds 2**63 - 1")
            return Node("const", "int", value=value)
        if type(value) is float:
            if not math.isfinite(value) or abs(value) > FLOAT32_MAX:
                raise self.fail(
                    node,
                    f"float literal {self.token(node)} is not finite in float32; literals "
                    f"must lie within +-{FLOAT32_MAX:.6g}",
                )
            return Node("const", "float", value=value)
        what = {str: "string", bytes: "bytes", bool: "boolean literal"}.get(type(value), "literal")
        raise self.refuse(node, what)

    def name(self, node: ast.Name, depth: int) -> Node:
        name = node.id
        if name in INDEX_NAMES:
            return Node("name", "int", op=name)
        if name == SCORE_NAME:
            if self.kind != "score_mod":
                raise self.fail(node, "'score' is only available in score_mod")
            return Node("name", "float", op=name)
        if name in self.inputs:
            rank = self.inputs[name].rank
            raise self.fail(
                node, f"input {name!r} has rank {rank}: read it with {rank} index(es), {name}[...]"
            )
        if name in FUNCTIONS:
            raise self.fail(node, f"{name!r} is a function: call it, {name}(...)")
        declared = ", ".join(self.inputs) or "none"
        raise self.fail(
            node,
            f"name {self.token(node)} is not allowed; names: "
            f"{'score, ' if self.kind == 'score_mod' else ''}{', '.join(INDEX_NAMES)} and the "
            f"declared inputs ({declared})",
        )

    def subscript(self, node: ast.Subscript, depth: int) -> Node:
        target = node.value
        if not isinstance(target, ast.Name) or target.id not in self.inputs:
            declared = ", ".join(self.inputs) or "none"
            raise self.fail(
                node,
                f"subscript {self.token(node)} is not allowed; only declared inputs "
                f"({declared}) can be indexed",
            )
        spec = self.inputs[target.id]
        items = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
        if len(items) != spec.rank:
            raise self.fail(
                node,
                f"{self.token(node)} takes {len(items)} index(es); input {spec.name!r} has "
                f"rank {spec.rank}",
            )
        indices = tuple(self.check(item, depth) for item in items)
        for item, index in zip(items, indices, strict=True):
            if index.type != "int":
                raise self.fail(
                    item, f"index {self.token(item)} of {spec.name!r} is {index.type}, not int"
                )
        return Node("read", spec.value_type, op=spec.name, args=indices)

    # ---- operators ----
    def number(self, node: ast.AST, depth: int, role: str) -> Node:
        checked = self.check(node, depth)
        if checked.type == "bool":
            raise self.fail(node, f"{self.token(node)} is boolean where {role} needs a number")
        return checked

    def boolean(self, node: ast.AST, depth: int, role: str) -> Node:
        checked = self.check(node, depth)
        if checked.type != "bool":
            raise self.fail(
                node, f"{self.token(node)} is a number where {role} needs a boolean (a comparison)"
            )
        return checked

    def binop(self, node: ast.BinOp, depth: int) -> Node:
        op = BINARY_OPS.get(type(node.op))
        if op is None:
            raise self.refuse(node, f"operator {REFUSED_OPS.get(type(node.op), '?')!r} in")
        left = self.number(node.left, depth, f"'{op}'")
        if op == "**":
            exponent = node.right
            if not (
                isinstance(exponent, ast.Constant)
                and type(exponent.value) is int
                and exponent.value == 2
            ):
                raise self.fail(node, f"{self.token(node)}: ** is allowed only as **2 (a square)")
            return Node("binary", left.type, op="**", args=(left, Node("const", "int", value=2)))
        right = self.number(node.right, depth, f"'{op}'")
        both_int = left.type == right.type == "int"
        result: ValueType = "int" if both_int and op != "/" else "float"
        return Node("binary", result, op=op, args=(left, right))

    def unaryop(self, node: ast.UnaryOp, depth: int) -> Node:
        if isinstance(node.op, ast.USub):
            operand = self.number(node.operand, depth, "unary '-'")
            return Node("neg", operand.type, args=(operand,))
        if isinstance(node.op, ast.Not):
            return Node("not", "bool", args=(self.boolean(node.operand, depth, "'not'"),))
        raise self.refuse(node, f"operator {REFUSED_OPS.get(type(node.op), '?')!r} in")

    def compare(self, node: ast.Compare, depth: int) -> Node:
        ops = []
        for op in node.ops:
            spelled = COMPARE_OPS.get(type(op))
            if spelled is None:
                raise self.refuse(node, f"comparison {REFUSED_OPS.get(type(op), '?')!r} in")
            ops.append(spelled)
        operands = [self.check(item, depth) for item in [node.left, *node.comparators]]
        for i, op in enumerate(ops):
            pair = operands[i].type, operands[i + 1].type
            numeric = "bool" not in pair
            if op in ORDERED_COMPARISONS and not numeric:
                raise self.fail(node, f"{self.token(node)}: '{op}' compares numbers, not booleans")
            if not numeric and pair != ("bool", "bool"):
                raise self.fail(
                    node, f"{self.token(node)}: '{op}' compares a boolean with a number"
                )
        return Node("compare", "bool", args=tuple(operands), value=tuple(ops))

    def boolop(self, node: ast.BoolOp, depth: int) -> Node:
        op = LOGIC_OPS[type(node.op)]
        values: list[Node] = []
        for item in node.values:
            value = self.boolean(item, depth, f"'{op}'")
            # (a and b) and c is a and b and c: one spelling, one hash
            values += value.args if value.kind == "logic" and value.op == op else (value,)
        return Node("logic", "bool", op=op, args=tuple(values))

    def call(self, node: ast.Call, depth: int) -> Node:
        func = node.func
        if not isinstance(func, ast.Name) or func.id not in FUNCTIONS:
            raise self.fail(
                node,
                f"call {self.token(func)} is not allowed; functions: {', '.join(FUNCTIONS)}",
            )
        name = func.id
        if node.keywords:
            raise self.fail(node, f"{self.token(node)}: {name}() takes no keyword arguments")
        if any(isinstance(a, ast.Starred) for a in node.args):
            raise self.refuse(node, "starred argument in")
        least, most = FUNCTIONS[name]
        if not least <= len(node.args) <= most:
            count = str(least) if least == most else f"{least} to {most}"
            raise self.fail(
                node, f"{self.token(node)}: {name}() takes {count} arguments, not {len(node.args)}"
            )
        if name == "where":
            condition = self.boolean(node.args[0], depth, "where()'s condition")
            then, other = (self.check(a, depth) for a in node.args[1:])
            if (then.type == "bool") != (other.type == "bool"):
                raise self.fail(node, f"{self.token(node)}: where() mixes a boolean and a number")
            result = _numeric_result(then, other) if then.type != "bool" else "bool"
            return Node("call", result, op=name, args=(condition, then, other))
        args = tuple(self.number(a, depth, f"{name}()") for a in node.args)
        result = "float" if name in FLOAT_FUNCTIONS else _numeric_result(*args)
        return Node("call", result, op=name, args=args)


def _numeric_result(*args: Node) -> ValueType:
    return "int" if all(a.type == "int" for a in args) else "float"


_HANDLERS = {
    ast.Constant: _Checker.constant,
    ast.Name: _Checker.name,
    ast.Subscript: _Checker.subscript,
    ast.BinOp: _Checker.binop,
    ast.UnaryOp: _Checker.unaryop,
    ast.Compare: _Checker.compare,
    ast.BoolOp: _Checker.boolop,
    ast.Call: _Checker.call,
}


_LINE_BREAK_RE = re.compile(r"\r\n?|\n")


def _joined_lines(text: str) -> str:
    """``text`` with its line breaks (``\\n``, ``\\r\\n``, ``\\r``) made whitespace: each line
    loses its comment and all but the last end in a line continuation, so that an expression
    may span lines (a YAML block, a Windows file) and keep its lines and columns for errors. A
    ``#`` inside a string literal is cut too: strings are refused anyway."""
    lines = [line.split("#", 1)[0] for line in _LINE_BREAK_RE.split(text)]
    while lines and not lines[-1].strip():  # nothing to continue onto
        lines.pop()
    return "".join(
        line if i == len(lines) - 1 else line + ("\n" if line.endswith("\\") else "\\\n")
        for i, line in enumerate(lines)
    )


def parse_expression(
    kind: ExpressionKind, text: str, inputs: Iterable[ModInput] | None = None
) -> Expression:
    """Check ``text`` as a ``kind`` expression over the declared ``inputs``. Raises a SpecError
    naming the offending token and what is allowed."""
    if kind not in ("score_mod", "mask_mod"):
        raise SpecError([f"expression kind {kind!r} is not allowed; use score_mod or mask_mod"])
    declared = declare_inputs(inputs)
    if not isinstance(text, str):
        raise SpecError([f"{kind} must be a string, not {type(text).__name__}"])
    if len(text) > MAX_EXPRESSION_CHARS:
        raise SpecError(
            [f"{kind} has {len(text)} characters; at most {MAX_EXPRESSION_CHARS} are allowed"]
        )
    if not _PRINTABLE_RE.match(text):
        bad = next(c for c in text if not _PRINTABLE_RE.match(c))
        raise SpecError(
            [
                f"{kind}: character {bad!r} at position {text.index(bad) + 1} is not allowed; "
                "expressions are printable ASCII"
            ]
        )
    text = _joined_lines(text)
    if not text.strip():
        raise SpecError([f"{kind} is empty; write an expression, e.g. q_idx >= kv_idx"])
    try:
        with warnings.catch_warnings():  # e.g. "1if": Python warns, then parses it
            warnings.simplefilter("ignore", SyntaxWarning)
            tree = ast.parse(text.strip(), mode="eval")
    except SyntaxError as exc:
        raise SpecError([f"{kind}: not an expression: {exc.msg} (column {exc.offset})"]) from None
    except (ValueError, RecursionError, MemoryError) as exc:
        raise SpecError([f"{kind}: cannot parse: {_cut(str(exc), 80)}"]) from None
    checker = _Checker(kind, text.strip(), declared)
    try:
        root = checker.check(tree.body)
    except RecursionError:
        raise SpecError([f"{kind}: the expression nests too deeply"]) from None
    expected: ValueType = "bool" if kind == "mask_mod" else "float"
    if kind == "mask_mod" and root.type != "bool":
        raise SpecError([f"mask_mod must be boolean (e.g. a comparison), not {root.type}"])
    if kind == "score_mod" and root.type == "bool":
        raise SpecError(["score_mod must be a number (the new score), not a boolean"])
    if root.type != expected:  # an int score_mod: the score is float
        root = Node("call", "float", op=FLOAT_CONVERSION, args=(root,))
    return Expression(kind, root, declared, origin=_PARSER)


def derived_expression(
    kind: ExpressionKind, root: Node, inputs: tuple[ModInput, ...]
) -> Expression:
    """An Expression over a tree kernelgen derived from a checked one (a score_mod's
    derivative, :mod:`kernelgen.specs.expression_grad`): verified like every tree
    (:func:`verify_tree`, within MAX_TREE_NODES and MAX_TREE_DEPTH) but not re-parsed from its
    text, which may be longer than MAX_EXPRESSION_CHARS. SpecError if it is not a checked
    tree."""
    return Expression(kind, root, verified_inputs(inputs), origin=_PARSER)


def checked_expression(
    kind: ExpressionKind, value: str | Expression, declared: tuple[ModInput, ...]
) -> Expression:
    """``value`` as a checked ``kind`` expression over the ``declared`` inputs: a string is
    parsed (SpecError on bad text); an Expression checked earlier must be of this kind and over
    these inputs (InputError otherwise)."""
    if isinstance(value, Expression):
        if value.kind != kind:
            raise InputError(f"{kind} is a checked {value.kind}; pass a {kind}")
        if value.inputs != declared:
            raise InputError(
                f"{kind} was checked against inputs {value.signature or 'none'}; mod_inputs are "
                f"{','.join(i.signature for i in declared) or 'none'}; pass the {kind} as a "
                "string (it is checked against the call's mod_inputs) or pass mod_inputs with "
                "the arrays it was checked against"
            )
        return value
    return _parsed(kind, value, declared)


@functools.lru_cache(maxsize=256)
def _parsed(kind: ExpressionKind, text: str, declared: tuple[ModInput, ...]) -> Expression:
    """parse_expression, once per (kind, text, inputs): calls with expressions check theirs on
    every call (failures are not cached: they raise again)."""
    return parse_expression(kind, text, declared)


def parse_score_mod(text: str, inputs: Iterable[ModInput] | None = None) -> Expression:
    """A checked ``score_mod``: a number, the new score (``score`` is the scaled q.k)."""
    return parse_expression("score_mod", text, inputs)


def parse_mask_mod(text: str, inputs: Iterable[ModInput] | None = None) -> Expression:
    """A checked ``mask_mod``: a boolean, true where key ``kv_idx`` is visible to ``q_idx``."""
    return parse_expression("mask_mod", text, inputs)


def inputs_from_arrays(arrays: Mapping[str, Any] | None) -> tuple[ModInput, ...]:
    """The declared inputs of a call's ``mod_inputs`` (name -> array): each array's dtype and
    number of dimensions, in name order. Raises InputTypeError / InputError naming the array."""
    if arrays is None:
        return ()
    if not isinstance(arrays, Mapping):
        raise InputTypeError(f"mod_inputs is {type(arrays).__name__}; pass a dict of name -> array")
    declared = []
    for name, array in arrays.items():
        label = f"mod_inputs[{_cut(repr(name))}]"
        dtype, shape = getattr(array, "dtype", None), getattr(array, "shape", None)
        if dtype is None or not isinstance(shape, Iterable):
            raise InputTypeError(
                f"{label} is {_cut(type(array).__name__)}; pass a NumPy, CuPy or torch array"
            )
        dtype_name = str(getattr(dtype, "name", dtype)).removeprefix("torch.")
        if dtype_name not in INPUT_DTYPES:
            raise InputTypeError(
                f"{label} has dtype {_cut(dtype_name)}; allowed: {', '.join(INPUT_DTYPES)}"
            )
        shape = tuple(shape)
        if not 1 <= len(shape) <= MAX_RANK:
            raise InputError(f"{label} has shape {shape}; allowed: 1 to {MAX_RANK} dimensions")
        try:
            declared.append(ModInput(name, dtype_name, len(shape)))
        except SpecError as exc:  # a bad name: the key of this argument
            raise InputError(f"mod_inputs: {'; '.join(exc.problems)}") from None
    try:
        return declare_inputs(declared)
    except SpecError as exc:
        raise InputError(f"mod_inputs: {'; '.join(exc.problems)}") from None


# --------------------------------------------------------------------------------------------
# Verifying a tree (what the checker builds, and nothing else)
# --------------------------------------------------------------------------------------------

# A checked tree may exceed the text's limits a little: `x ** 2` holds a literal 2 the checker
# does not count, and an int score_mod is wrapped in a conversion to float.
MAX_TREE_NODES = 2 * MAX_NODES
MAX_TREE_DEPTH = MAX_DEPTH + 2
_VALUE_TYPES = ("int", "float", "bool")
_BINARY_SPELLINGS = frozenset(BINARY_OPS.values())
_COMPARE_SPELLINGS = frozenset(COMPARE_OPS.values())
_LOGIC_SPELLINGS = frozenset(LOGIC_OPS.values())
_NUMERIC = ("int", "float")
FLOAT_CONVERSION = "float"  # the call an int score_mod's root is wrapped in


def verified_inputs(inputs: Any) -> tuple[ModInput, ...]:
    """``inputs`` if it is a tuple of valid ModInputs in name order, declared once each (each is
    validated again, so none can hold a name the checks refuse); SpecError otherwise."""
    if type(inputs) is not tuple or not all(type(i) is ModInput for i in inputs):
        raise SpecError(["mod inputs must be a tuple of ModInput(name, dtype, rank) values"])
    rebuilt = tuple(ModInput(i.name, i.dtype, i.rank) for i in inputs)  # validates each again
    if declare_inputs(rebuilt) != rebuilt:
        raise SpecError(["mod inputs must be in name order"])
    return rebuilt


def verify_tree(kind: Any, root: Any, inputs: Any) -> None:
    """Raise a SpecError unless ``root`` is a tree the checker builds for a ``kind`` expression
    over ``inputs``: exact Node objects of the known kinds, operators and functions from the
    tables, names from the language or the declared inputs, literals that are plain finite
    numbers, types that follow the typing rules, within the size limits. Linear in the tree
    (and stops at MAX_TREE_NODES, so a tree that shares subtrees cannot make it exponential);
    the emitter calls it again, so that only such trees become CUDA."""
    if type(kind) is not str or kind not in ("score_mod", "mask_mod"):
        raise SpecError(
            [f"expression kind {_cut(repr(kind))} is not allowed; use score_mod or mask_mod"]
        )
    declared = {i.name: i for i in verified_inputs(inputs)}
    for node, depth in _bounded_walk(kind, root):
        problem = _node_problem(kind, node, declared, depth == 0)
        if problem:
            raise SpecError([f"{kind}: not a checked expression tree: {problem}"])
    expected = "bool" if kind == "mask_mod" else "float"
    if root.type != expected:
        raise SpecError(
            [f"{kind}: not a checked expression tree: it gives {root.type}, not {expected}"]
        )


def _bounded_walk(kind: str, root: Any) -> Iterator[tuple[Any, int]]:
    """(node, depth) of every node under ``root``, depth first; a SpecError past MAX_TREE_NODES
    visits or MAX_TREE_DEPTH levels (a node reached twice counts twice). Only a Node's args are
    entered: the caller checks each node as it comes."""
    visited = 0
    pending: list[tuple[Any, int]] = [(root, 0)]
    while pending:
        node, depth = pending.pop()
        visited += 1
        if visited > MAX_TREE_NODES or depth > MAX_TREE_DEPTH:
            raise SpecError(
                [
                    f"{kind}: not a checked expression tree: more than {MAX_TREE_NODES} "
                    f"nodes or {MAX_TREE_DEPTH} levels"
                ]
            )
        yield node, depth
        if type(node) is Node and type(node.args) is tuple:
            pending += [(arg, depth + 1) for arg in node.args]


def _check_tree_size(kind: str, root: Any) -> None:
    """A SpecError if the tree under ``root`` is larger or deeper than a checked tree can be."""
    for _ in _bounded_walk(kind, root):
        pass


def _node_problem(kind: str, node: Any, declared: Mapping[str, ModInput], is_root: bool) -> str:
    """What makes ``node`` (not its arguments' own contents) unlike a checked node, or ''."""
    if type(node) is not Node:
        return f"{_cut(type(node).__name__)} is not a Node"
    if type(node.kind) is not str or type(node.op) is not str or type(node.args) is not tuple:
        return "a node's kind, op or args has the wrong type"
    if node.type not in _VALUE_TYPES or type(node.type) is not str:
        return f"type {_cut(repr(node.type))} is not one of {', '.join(_VALUE_TYPES)}"
    if not all(type(a) is Node for a in node.args):
        return f"an argument of a {_cut(node.kind)} node is not a Node"
    types = tuple(a.type for a in node.args)
    if not all(t in _VALUE_TYPES and type(t) is str for t in types):
        return "an argument has an unknown type"
    check = _NODE_CHECKS.get(node.kind)
    if check is None:
        return f"node kind {_cut(repr(node.kind))} is not allowed"
    if node.kind not in ("const", "compare") and node.value is not None:
        return f"a {node.kind} node holds a value"
    return check(kind, node, types, declared, is_root)


def _const_problem(kind: str, node: Node, types: tuple[str, ...], *_: Any) -> str:
    value = node.value
    if node.op or node.args:
        return "a literal has an operator or arguments"
    if node.type == "int" and type(value) is int and 0 <= value <= INT64_MAX:
        return ""
    if (
        node.type == "float"
        and type(value) is float
        and math.isfinite(value)
        and 0.0 <= value <= FLOAT32_MAX
        and math.copysign(1.0, value) > 0
    ):
        return ""
    return f"literal {_cut(repr(value))} of type {node.type} is not a literal the language has"


def _name_problem(kind: str, node: Node, types: tuple[str, ...], *_: Any) -> str:
    if node.args:
        return "a name has arguments"
    if node.op in INDEX_NAMES and node.type == "int":
        return ""
    if node.op == SCORE_NAME and node.type == "float" and kind == "score_mod":
        return ""
    return f"name {_cut(repr(node.op))} ({node.type}) is not allowed in {kind}"


def _read_problem(
    kind: str, node: Node, types: tuple[str, ...], declared: Mapping[str, ModInput], *_: Any
) -> str:
    spec = declared.get(node.op)
    if spec is None:
        return f"read of {_cut(repr(node.op))}, which is not a declared input"
    if len(types) != spec.rank or any(t != "int" for t in types):
        return f"a read of {spec.name!r} needs {spec.rank} int index(es)"
    if node.type != spec.value_type:
        return f"a read of {spec.name!r} gives {spec.value_type}, not {node.type}"
    return ""


def _unary_problem(kind: str, node: Node, types: tuple[str, ...], *_: Any) -> str:
    if node.op or len(types) != 1:
        return f"a {node.kind} node takes one argument and no operator"
    wanted = ("bool",) if node.kind == "not" else _NUMERIC
    if types[0] not in wanted or node.type != (types[0] if node.kind == "neg" else "bool"):
        return f"{node.kind} of {types[0]} giving {node.type}"
    return ""


def _binary_problem(kind: str, node: Node, types: tuple[str, ...], *_: Any) -> str:
    if node.op not in _BINARY_SPELLINGS or len(types) != 2 or "bool" in types:
        return f"binary {_cut(repr(node.op))} of {', '.join(types) or 'nothing'}"
    if node.op == "**":
        exponent = node.args[1]
        if not (exponent.kind == "const" and type(exponent.value) is int and exponent.value == 2):
            return "** takes only the literal 2"
        wanted = types[0]
    else:
        wanted = "int" if types == ("int", "int") and node.op != "/" else "float"
    return "" if node.type == wanted else f"{node.op} giving {node.type}, not {wanted}"


def _compare_problem(kind: str, node: Node, types: tuple[str, ...], *_: Any) -> str:
    ops = node.value
    if (
        node.op
        or node.type != "bool"
        or type(ops) is not tuple
        or len(ops) < 1
        or len(types) != len(ops) + 1
        or not all(type(op) is str and op in _COMPARE_SPELLINGS for op in ops)
    ):
        return "a comparison's operators or operands are malformed"
    for op, pair in zip(ops, itertools.pairwise(types), strict=True):
        numeric = "bool" not in pair
        if (op in ORDERED_COMPARISONS and not numeric) or (
            not numeric and pair != ("bool", "bool")
        ):
            return f"'{op}' of {pair[0]} and {pair[1]}"
    return ""


def _logic_problem(kind: str, node: Node, types: tuple[str, ...], *_: Any) -> str:
    if node.op not in _LOGIC_SPELLINGS or len(types) < 2 or node.type != "bool":
        return f"logic {_cut(repr(node.op))} of {len(types)} operand(s)"
    return "" if all(t == "bool" for t in types) else f"'{node.op}' of a number"


def _call_problem(
    kind: str, node: Node, types: tuple[str, ...], declared: Any, is_root: bool
) -> str:
    name = node.op
    if name == FLOAT_CONVERSION:  # only around an int score_mod
        ok = is_root and kind == "score_mod" and types == ("int",) and node.type == "float"
        return "" if ok else "a conversion to float other than around an int score_mod"
    if name not in FUNCTIONS:
        return f"call of {_cut(repr(name))}, which is not a function of the language"
    least, most = FUNCTIONS[name]
    if not least <= len(types) <= most:
        return f"{name}() with {len(types)} argument(s)"
    if name == "where":
        condition, then, other = types
        if condition != "bool" or (then == "bool") != (other == "bool"):
            return "where() with a number condition or a boolean and a number"
        wanted = "bool" if then == "bool" else ("int" if then == other == "int" else "float")
    elif "bool" in types:
        return f"{name}() of a boolean"
    elif name in FLOAT_FUNCTIONS:
        wanted = "float"
    else:
        wanted = "int" if all(t == "int" for t in types) else "float"
    return "" if node.type == wanted else f"{name}() giving {node.type}, not {wanted}"


_NODE_CHECKS: dict[str, Any] = {
    "const": _const_problem,
    "name": _name_problem,
    "read": _read_problem,
    "neg": _unary_problem,
    "not": _unary_problem,
    "binary": _binary_problem,
    "compare": _compare_problem,
    "logic": _logic_problem,
    "call": _call_problem,
}


# --------------------------------------------------------------------------------------------
# Canonical text
# --------------------------------------------------------------------------------------------


def _precedence(node: Node) -> int:
    if node.kind in ("binary", "logic"):
        return PRECEDENCE[node.op]
    if node.kind == "compare":
        return PRECEDENCE["compare"]
    if node.kind in ("neg", "not"):
        return PRECEDENCE[node.kind]
    return PRECEDENCE["atom"]


def _wrapped(node: Node, parenthesize: bool) -> str:
    text = canonical_text(node)
    return f"({text})" if parenthesize else text


def canonical_text(node: Node) -> str:
    """The one spelling of a checked tree: single spaces around binary operators, parentheses
    only where precedence needs them, floats as Python's shortest repr, ints in decimal."""
    kind = node.kind
    if kind == "const":
        return repr(node.value)
    if kind == "name":
        return node.op
    if kind == "read":
        return f"{node.op}[{', '.join(canonical_text(a) for a in node.args)}]"
    if kind == "call":
        if node.op == "float":  # an int score_mod's implicit conversion: not part of the text
            return canonical_text(node.args[0])
        return f"{node.op}({', '.join(canonical_text(a) for a in node.args)})"
    own = _precedence(node)
    if kind == "neg":
        return "-" + _wrapped(node.args[0], _precedence(node.args[0]) <= own)
    if kind == "not":
        return "not " + _wrapped(node.args[0], _precedence(node.args[0]) < own)
    if kind == "logic":
        return f" {node.op} ".join(_wrapped(a, _precedence(a) <= own) for a in node.args)
    if kind == "compare":
        parts = [_wrapped(node.args[0], _precedence(node.args[0]) <= own)]
        for op, operand in zip(node.value, node.args[1:], strict=True):  # type: ignore[arg-type]
            parts += [op, _wrapped(operand, _precedence(operand) <= own)]
        return " ".join(parts)
    left, right = node.args
    if node.op == "**":
        return f"{_wrapped(left, _precedence(left) <= own)} ** 2"
    return (
        f"{_wrapped(left, _precedence(left) < own)} {node.op} "
        f"{_wrapped(right, _precedence(right) <= own)}"
    )


# --------------------------------------------------------------------------------------------
# Spec fields
# --------------------------------------------------------------------------------------------

_SIGNATURE_RE = re.compile(r"\s*([^:\s]+)\s*:\s*([a-z0-9]+)\s*\[\s*([0-9]+)\s*\]\s*\Z")


def parse_input_signature(text: Any) -> ModInput:
    """A declared input from its signature ``name:dtype[rank]`` (e.g. ``doc:int32[2]``), the
    spelling of a spec's ``mod_inputs`` entries; SpecError names the entry."""
    match = _SIGNATURE_RE.match(text) if isinstance(text, str) else None
    if match is None:
        raise SpecError(
            [
                f"mod_inputs entry {_cut(repr(text))} is not allowed; write name:dtype[rank], "
                f"e.g. doc:int32[2] (dtypes: {', '.join(INPUT_DTYPES)})"
            ]
        )
    name, dtype, rank = match.groups()
    return ModInput(name, dtype, int(rank))


def spec_expressions(
    score_mod: str | None, mask_mod: str | None, mod_inputs: Iterable[str]
) -> tuple[Expression | None, Expression | None, tuple[ModInput, ...]]:
    """A spec's checked (score_mod, mask_mod) (None where absent) and its declared inputs (from
    their signatures, in name order); SpecError lists every problem."""
    declared = declare_inputs(parse_input_signature(s) for s in mod_inputs)
    return (
        None if score_mod is None else parse_score_mod(score_mod, declared),
        None if mask_mod is None else parse_mask_mod(mask_mod, declared),
        declared,
    )
