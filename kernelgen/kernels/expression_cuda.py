"""CUDA C++ of checked expressions (:mod:`kernelgen.specs.expressions`): ``__device__`` functions,
the struct of extra inputs they read and the kernel parameters that fill it.

Every spelling is a table entry below; the user's text reaches the output only as the tree's
validated names (index names, ``score``, declared input names inside fixed prefixes and
suffixes) and re-spelled numbers. The ABI (docs/expressions.md):

- ``struct KgModInputs`` holds, per declared input in name order, ``const T* <name>_ptr``,
  ``long long <name>_shape[rank]`` and ``long long <name>_stride[rank]`` (elements; 0
  broadcasts).
- A kernel receives them flattened as parameters (:func:`input_params`: ``mod_<name>``,
  ``mod_<name>_shape_<d>``, ``mod_<name>_stride_<d>``) and builds the struct with
  :func:`input_struct_init`; the expression functions take it by const reference.
- ``float kg_score_mod(float score, long long b, long long h, long long q_idx, long long kv_idx,
  const KgModInputs& in)`` and ``bool kg_mask_mod(long long b, ..., const KgModInputs& in)``;
  a backward kernel adds ``kg_score_mod_grad``, d(score_mod)/d(score) under kg_score_mod's
  signature (:func:`score_mod_grad_source`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from kernelgen.errors import SpecError
from kernelgen.specs.expressions import (
    Expression,
    ModInput,
    Node,
    canonical_text,
    verified_inputs,
    verify_tree,
    walk,
)

STRUCT_NAME = "KgModInputs"
STRUCT_ARG = "in"
FUNCTION_NAMES = {"score_mod": "kg_score_mod", "mask_mod": "kg_mask_mod"}
GRAD_FUNCTION_NAME = "kg_score_mod_grad"  # d(score_mod)/d(score), kg_score_mod's signature
# The names a device function of each kind may be emitted under.
ALLOWED_FUNCTION_NAMES = {
    "score_mod": (FUNCTION_NAMES["score_mod"], GRAD_FUNCTION_NAME),
    "mask_mod": (FUNCTION_NAMES["mask_mod"],),
}
RETURN_CTYPE = {"score_mod": "float", "mask_mod": "bool"}
INDEX_PARAMS = ("b", "h", "q_idx", "kv_idx")
SCORE_NAME = "score"
# The language's names -> the device function's parameters (the same words, from this table).
NAME_CXX = {name: name for name in (SCORE_NAME, *INDEX_PARAMS)}
# Value types -> C++ types: ints are 64-bit, floats fp32 (the kernels' accumulation type).
VALUE_CTYPE = {"int": "long long", "float": "float", "bool": "bool"}
ZERO = {"int": "0LL", "float": "0.0f", "bool": "false"}
INDEX_CTYPE = "long long"
LOCAL_PREFIX = "kg_v"  # locals of a device function: kg_v0, kg_v1, ...
# The most characters one device function may hold. Emission is linear in the tree (each node
# is written once, in at most a few dozen characters), so a tree within the parser's limits
# stays far below it; a backstop against what the limits miss.
MAX_FUNCTION_CHARS = 65536


@dataclass(frozen=True)
class InputElement:
    """How one input dtype is stored and read."""

    ctype: str  # element type behind the pointer
    load: str  # the element at {0} as its value type
    header: str | None = None


INPUT_ELEMENT: dict[str, InputElement] = {
    "float32": InputElement("float", "{0}"),
    "float16": InputElement("__half", "__half2float({0})", "cuda_fp16.h"),
    "bfloat16": InputElement("__nv_bfloat16", "__bfloat162float({0})", "cuda_bf16.h"),
    "int32": InputElement("int", "static_cast<long long>({0})"),
    "int64": InputElement("long long", "{0}"),
    "bool": InputElement("bool", "{0}"),
}
# (operator, arithmetic type) -> spelling of the operation on operands {0}, {1}.
BINARY_CXX: dict[tuple[str, str], str] = {
    ("+", "int"): "({0} + {1})",
    ("+", "float"): "({0} + {1})",
    ("-", "int"): "({0} - {1})",
    ("-", "float"): "({0} - {1})",
    ("*", "int"): "({0} * {1})",
    ("*", "float"): "({0} * {1})",
    ("/", "float"): "({0} / {1})",
    ("//", "int"): "kg_floordiv_i64({0}, {1})",
    ("//", "float"): "kg_floordiv_f32({0}, {1})",
    ("%", "int"): "kg_mod_i64({0}, {1})",
    ("%", "float"): "kg_mod_f32({0}, {1})",
    ("**", "int"): "kg_square_i64({0})",
    ("**", "float"): "kg_square_f32({0})",
}
COMPARE_CXX = {"<": "<", "<=": "<=", ">": ">", ">=": ">=", "==": "==", "!=": "!="}
LOGIC_CXX = {"and": " && ", "or": " || "}
UNARY_CXX = {"neg": "(-{0})", "not": "(!{0})"}
# (function, result type) -> spelling; min/max fold left over more than two arguments.
CALL_CXX: dict[tuple[str, str], str] = {
    ("min", "int"): "kg_min_i64({0}, {1})",
    ("min", "float"): "kg_min_f32({0}, {1})",
    ("max", "int"): "kg_max_i64({0}, {1})",
    ("max", "float"): "kg_max_f32({0}, {1})",
    ("abs", "int"): "kg_abs_i64({0})",
    ("abs", "float"): "fabsf({0})",
    ("exp", "float"): "expf({0})",
    ("log", "float"): "logf({0})",
    ("tanh", "float"): "tanhf({0})",
    ("sqrt", "float"): "sqrtf({0})",
    ("float", "float"): "{0}",
    ("where", "int"): "({0} ? {1} : {2})",
    ("where", "float"): "({0} ? {1} : {2})",
    ("where", "bool"): "({0} ? {1} : {2})",
}
CONVERT_CXX = {("int", "float"): "static_cast<float>({0})"}
# The helpers the tables name, written once per source (fixed text, nothing of the user's).
# Ints: Python's floor division and modulo (the remainder takes the divisor's sign), not C's
# truncation; a zero divisor gives 0; b == -1 negates with wraparound (no overflow trap).
# Floats: x // y = floor(x / y), x % y = x - y * floor(x / y). min/max: Python's (the first
# argument unless a later one is strictly smaller / greater).
HELPERS = r"""#ifndef KG_EXPRESSION_HELPERS
#define KG_EXPRESSION_HELPERS
__device__ __forceinline__ long long kg_floordiv_i64(long long x, long long y) {
  if (y == 0) return 0;
  if (y == -1) return static_cast<long long>(0ULL - static_cast<unsigned long long>(x));
  const long long q = x / y;  // truncated toward zero
  return (q * y != x && ((x < 0) != (y < 0))) ? q - 1 : q;
}
__device__ __forceinline__ long long kg_mod_i64(long long x, long long y) {
  if (y == 0 || y == -1) return 0;
  const long long r = x % y;  // the sign of x
  return (r != 0 && ((r < 0) != (y < 0))) ? r + y : r;
}
__device__ __forceinline__ float kg_floordiv_f32(float x, float y) { return floorf(x / y); }
__device__ __forceinline__ float kg_mod_f32(float x, float y) { return x - y * floorf(x / y); }
__device__ __forceinline__ long long kg_square_i64(long long x) { return x * x; }
__device__ __forceinline__ float kg_square_f32(float x) { return x * x; }
__device__ __forceinline__ long long kg_min_i64(long long x, long long y) { return y < x ? y : x; }
__device__ __forceinline__ float kg_min_f32(float x, float y) { return y < x ? y : x; }
__device__ __forceinline__ long long kg_max_i64(long long x, long long y) { return y > x ? y : x; }
__device__ __forceinline__ float kg_max_f32(float x, float y) { return y > x ? y : x; }
__device__ __forceinline__ long long kg_abs_i64(long long x) { return x < 0 ? -x : x; }
#endif  // KG_EXPRESSION_HELPERS
"""
# What the canonical text in a comment may hold (it is built from the checked tree; checked
# again here so that nothing can end the comment or continue it onto the next line).
_COMMENT_SAFE = re.compile(r"[A-Za-z0-9_ .,+\-*/%<>=!()\[\]]*\Z")


def _member(name: str, part: str) -> str:
    """A struct member of input ``name``: ``<name>_ptr``, ``<name>_shape``, ``<name>_stride``
    (no C++ keyword ends so; distinct names give distinct members)."""
    return f"{name}_{part}"


def reader_name(name: str) -> str:
    return f"kg_read_{name}"


def _literal(node: Node) -> str:
    if node.type == "int":
        return f"{node.value}LL"
    text = repr(float(node.value))  # type: ignore[arg-type]
    if not re.fullmatch(r"[0-9]+(\.[0-9]*)?(e[+-]?[0-9]+)?", text):
        raise SpecError([f"float literal {text} has no C++ spelling"])  # unreachable: checked
    return text + "f"


_CALL_FORM = re.compile(r"[A-Za-z_][A-Za-z_0-9<>]*\(")


def _bare(code: str) -> str:
    """``code`` without parentheses around all of it (where it stands alone: an argument)."""
    if not (code.startswith("(") and code.endswith(")")):
        return code
    depth = 0
    for position, char in enumerate(code):
        depth += {"(": 1, ")": -1}.get(char, 0)
        if depth == 0 and position < len(code) - 1:
            return code  # the first parenthesis closes before the end: "(a) + (b)"
    return code[1:-1]


def _fill(pattern: str, *operands: str) -> str:
    """A table spelling with its operands; a function call's arguments lose their outer
    parentheses (each stands alone between commas)."""
    if _CALL_FORM.match(pattern):
        operands = tuple(_bare(o) for o in operands)
    return pattern.format(*operands)


EXACT_FLOAT_INT = 2**24  # ints up to this magnitude are exact in fp32


def _convert(node: Node, code: str, target: str) -> str:
    """``code`` (the value of ``node``) as ``target``; an int literal exact in fp32 becomes a
    float literal."""
    if node.type == target:
        return code
    if node.kind == "const" and abs(node.value) <= EXACT_FLOAT_INT:  # type: ignore[arg-type]
        return _literal(Node("const", "float", value=float(node.value)))  # type: ignore[arg-type]
    return _fill(CONVERT_CXX[node.type, target], code)


def _too_large(kind: str) -> str:
    return (
        f"{kind}: its CUDA function would hold more than {MAX_FUNCTION_CHARS} characters, the "
        "most allowed (write a shorter expression)"
    )


class _Emitter:
    """The C++ of one checked tree: an expression, plus statements binding each operand that a
    chained comparison spells twice (``a < b < c`` tests ``a < b`` and ``b < c``) to a local, so
    that every node is written once and the source grows linearly with the tree. The bound
    operands are evaluated before the expression (pure and total: reads are bounds-checked, a
    zero int divisor gives 0), which changes no value."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.statements: list[str] = []
        self.statement_chars = 0

    def code(self, node: Node) -> str:
        """``node``'s C++; a SpecError as soon as it or the statements outgrow the function's
        limit (checked at every node, so no emission runs far past it)."""
        code = self._code(node)
        if len(code) + self.statement_chars > MAX_FUNCTION_CHARS:
            raise SpecError([_too_large(self.kind)])
        return code

    def bind(self, node: Node, code: str) -> str:
        """A local holding ``code`` (the value of ``node``); leaves need none."""
        if node.kind in ("const", "name"):
            return code
        local = f"{LOCAL_PREFIX}{len(self.statements)}"
        statement = f"const {VALUE_CTYPE[node.type]} {local} = {_bare(code)};"
        self.statements.append(statement)
        self.statement_chars += len(statement)
        return local

    def _code(self, node: Node) -> str:
        kind = node.kind
        if kind == "const":
            return _literal(node)
        if kind == "name":
            return NAME_CXX[node.op]
        args = [self.code(a) for a in node.args]
        if kind == "read":
            indices = [_bare(a) for a in args]
            return f"{reader_name(node.op)}({', '.join([STRUCT_ARG, *indices])})"
        if kind in UNARY_CXX:
            return _fill(UNARY_CXX[kind], args[0])
        if kind == "logic":
            return "(" + LOGIC_CXX[node.op].join(args) + ")"
        if kind == "compare":
            return self.compare(node, args)
        if kind == "binary":
            operand_type = node.type
            left = _convert(node.args[0], args[0], operand_type)
            if node.op == "**":
                return _fill(BINARY_CXX["**", operand_type], left)
            right = _convert(node.args[1], args[1], operand_type)
            return _fill(BINARY_CXX[node.op, operand_type], left, right)
        if node.op == "where":
            then = _convert(node.args[1], args[1], node.type)
            other = _convert(node.args[2], args[2], node.type)
            return _fill(CALL_CXX["where", node.type], args[0], then, other)
        converted = [_convert(n, a, node.type) for a, n in zip(args, node.args, strict=True)]
        if node.op in ("min", "max"):
            result = converted[0]
            for arg in converted[1:]:
                result = _fill(CALL_CXX[node.op, node.type], result, arg)
            return result
        return _fill(CALL_CXX[node.op, node.type], converted[0])

    def compare(self, node: Node, args: list[str]) -> str:
        """A comparison; in a chain each operand between two operators is bound once."""
        operands = [
            code if i in (0, len(args) - 1) else self.bind(operand, code)
            for i, (operand, code) in enumerate(zip(node.args, args, strict=True))
        ]
        tests = []
        for i, op in enumerate(node.value):  # type: ignore[arg-type]
            x, y = node.args[i], node.args[i + 1]
            common = "float" if "float" in (x.type, y.type) else x.type
            left, right = _convert(x, operands[i], common), _convert(y, operands[i + 1], common)
            tests.append(f"({left} {COMPARE_CXX[op]} {right})")
        return tests[0] if len(tests) == 1 else "(" + " && ".join(tests) + ")"


def headers(inputs: tuple[ModInput, ...]) -> list[str]:
    """The CUDA headers the inputs' element types need."""
    found = {INPUT_ELEMENT[i.dtype].header for i in inputs}
    return sorted(h for h in found if h)


def input_struct(inputs: tuple[ModInput, ...]) -> str:
    """The struct of extra inputs and one bounds-checked reader per input."""
    lines = [
        "// Extra inputs of score_mod / mask_mod, in name order: element pointer, shape and",
        "// strides in elements (a stride of 0 broadcasts).",
        f"struct {STRUCT_NAME} {{",
    ]
    inputs = verified_inputs(tuple(inputs))
    for spec in inputs:
        element = INPUT_ELEMENT[spec.dtype]
        lines += [
            f"  const {element.ctype}* {_member(spec.name, 'ptr')};  // {spec.signature}",
            f"  {INDEX_CTYPE} {_member(spec.name, 'shape')}[{spec.rank}];",
            f"  {INDEX_CTYPE} {_member(spec.name, 'stride')}[{spec.rank}];",
        ]
    lines.append("};")
    for spec in inputs:
        element = INPUT_ELEMENT[spec.dtype]
        value_ctype = VALUE_CTYPE[spec.value_type]
        indices = [f"i{d}" for d in range(spec.rank)]
        shape, stride = _member(spec.name, "shape"), _member(spec.name, "stride")
        params = ", ".join(f"{INDEX_CTYPE} {i}" for i in indices)
        offset = " + ".join(f"{i} * {STRUCT_ARG}.{stride}[{d}]" for d, i in enumerate(indices))
        element_at = f"{STRUCT_ARG}.{_member(spec.name, 'ptr')}[{offset}]"
        lines += [
            f"// {spec.signature}; an index outside the array reads {ZERO[spec.value_type]}",
            f"__device__ __forceinline__ {value_ctype} {reader_name(spec.name)}(",
            f"    const {STRUCT_NAME}& {STRUCT_ARG}, {params}) {{",
        ]
        lines += [
            f"  if ({i} < 0 || {i} >= {STRUCT_ARG}.{shape}[{d}]) return {ZERO[spec.value_type]};"
            for d, i in enumerate(indices)
        ]
        lines += [f"  return {element.load.format(element_at)};", "}"]
    return "\n".join(lines) + "\n"


def device_function(expression: Expression, name: str | None = None) -> str:
    """``expression`` as a ``__device__ __forceinline__`` function under a comment holding its
    canonical text (docs/expressions.md for the signatures), named ``name`` (one of
    ALLOWED_FUNCTION_NAMES of its kind; by default kg_score_mod / kg_mask_mod). The tree is
    verified again here (:func:`kernelgen.specs.expressions.verify_tree`), so that only trees the
    checker builds become CUDA, and the function may hold at most MAX_FUNCTION_CHARS
    characters."""
    if type(expression) is not Expression:
        raise SpecError([f"expected a checked Expression, not {type(expression).__name__}"])
    kind = expression.kind
    verify_tree(kind, expression.root, expression.inputs)
    allowed = ALLOWED_FUNCTION_NAMES[kind]
    function_name = allowed[0] if name is None else name
    if function_name not in allowed:
        raise SpecError(
            [f"{kind}: function name {name!r} is not allowed; use one of {', '.join(allowed)}"]
        )
    comment = canonical_text(expression.root)
    if not _COMMENT_SAFE.match(comment):  # unreachable: the printer writes only these
        raise SpecError([f"{kind}: canonical text {comment[:80]!r} cannot go into a comment"])
    params = [f"{INDEX_CTYPE} {name}" for name in INDEX_PARAMS]
    if kind == "score_mod":
        params.insert(0, "float score")
    params.append(f"const {STRUCT_NAME}& {STRUCT_ARG}")
    names = (SCORE_NAME, *INDEX_PARAMS) if kind == "score_mod" else INDEX_PARAMS
    unused = [n for n in names if not expression.uses(n)]
    if not any(node.kind == "read" for node in walk(expression.root)):
        unused.append(STRUCT_ARG)
    emitter = _Emitter(kind)
    body = _bare(emitter.code(expression.root))
    source = "\n".join(
        [
            f"// {kind} {expression.hash}: {comment}",
            f"// inputs: {expression.signature or 'none'}",
            f"__device__ __forceinline__ {RETURN_CTYPE[kind]} {function_name}(",
            f"    {', '.join(params)}) {{",
            *[f"  (void){name};" for name in unused],
            *[f"  {statement}" for statement in emitter.statements],
            f"  return {body};",
            "}",
            "",
        ]
    )
    if len(source) > MAX_FUNCTION_CHARS:  # unreachable within the parser's limits: a backstop
        raise SpecError([_too_large(kind)])
    return source


def expression_source(*expressions: Expression | None) -> str:
    """The helpers, the input struct and readers, and each expression's function: what a kernel
    source includes before its kernels. Every expression must declare the same inputs."""
    given = [e for e in expressions if e is not None]
    functions = [device_function(e) for e in given]  # each verified first
    inputs = given[0].inputs if given else ()
    if any(e.inputs != inputs for e in given):
        raise SpecError(["score_mod and mask_mod must be checked against the same mod inputs"])
    if len({e.kind for e in given}) != len(given):
        raise SpecError(["at most one score_mod and one mask_mod per kernel"])
    return "\n".join([HELPERS, input_struct(inputs), *functions])


def score_mod_grad_source(score_mod: Expression) -> str:
    """``kg_score_mod_grad``, d(score_mod)/d(score) (:func:`kernelgen.specs.expression_grad.
    score_mod_derivative`), with kg_score_mod's signature: a backward kernel includes it after
    :func:`expression_source` (the helpers and the inputs' struct it uses). InputError where
    the derivative is not defined."""
    from kernelgen.specs.expression_grad import score_mod_derivative

    derivative = score_mod_derivative(score_mod)
    return (
        f"// {GRAD_FUNCTION_NAME}: the derivative of score_mod {score_mod.hash} with respect to "
        "score\n" + device_function(derivative, GRAD_FUNCTION_NAME)
    )


def pointer_param(name: str) -> str:
    """The kernel parameter of input ``name``'s element pointer.

    The parameters of the inputs are ``mod_<name>_ptr``, ``mod_<name>_shape_<d>`` and
    ``mod_<name>_stride_<d>`` (d: one digit, ranks are at most 4). The ending says which of the
    three a parameter is and what is left is the name, so distinct (input, role, axis) give
    distinct parameters (``a``'s shape and an input ``a_shape_0`` included); and none ends like
    the kernels' own ``mod_``-names (the struct variable ``mod_inputs``)."""
    return f"mod_{name}_ptr"


def shape_param(name: str, axis: int) -> str:
    """The kernel parameter of input ``name``'s size along ``axis`` (:func:`pointer_param`)."""
    return f"mod_{name}_shape_{axis}"


def stride_param(name: str, axis: int) -> str:
    """The kernel parameter of input ``name``'s stride (elements) along ``axis``."""
    return f"mod_{name}_stride_{axis}"


def input_params(inputs: tuple[ModInput, ...]) -> list[tuple[str, str]]:
    """(C++ type, name) of the kernel parameters that carry the inputs, in order: for each
    input its pointer, then its shape, then its strides (elements)."""
    params = []
    for spec in verified_inputs(tuple(inputs)):
        params.append((f"const {INPUT_ELEMENT[spec.dtype].ctype}*", pointer_param(spec.name)))
        params += [(INDEX_CTYPE, shape_param(spec.name, d)) for d in range(spec.rank)]
        params += [(INDEX_CTYPE, stride_param(spec.name, d)) for d in range(spec.rank)]
    return params


def input_struct_init(inputs: tuple[ModInput, ...], variable: str = "mod_inputs") -> str:
    """C++ statements declaring ``variable`` and filling it from :func:`input_params`."""
    lines = [f"{STRUCT_NAME} {variable};"]
    for spec in verified_inputs(tuple(inputs)):
        name = spec.name
        lines.append(f"{variable}.{_member(name, 'ptr')} = {pointer_param(name)};")
        for d in range(spec.rank):
            lines.append(f"{variable}.{_member(name, 'shape')}[{d}] = {shape_param(name, d)};")
            lines.append(f"{variable}.{_member(name, 'stride')}[{d}] = {stride_param(name, d)};")
    if not inputs:
        lines.append(f"(void){variable};")
    return "\n".join(lines)
