"""Hostile and unusual input around user expressions: emitted CUDA that stays linear in the
expression, trees that reach the emitter only as the checker builds them, kernel parameter names
that cannot collide, typed errors naming mod_inputs, line breaks, strict integer spec fields and
the scale's bounds (docs/expressions.md, docs/variants.md)."""

from __future__ import annotations

import dataclasses
import math
import time

import numpy as np
import pytest

import kernelgen
from kernelgen.calls.attention import MAX_SCALE, _call_plan_key, check_inputs, describe
from kernelgen.calls.block_mask import block_mask_reference
from kernelgen.errors import CPUBackendWarning, InputError, InputTypeError, SpecError
from kernelgen.kernels import expression_cuda as expression_cuda
from kernelgen.kernels.expression_cuda import expression_source, input_params, input_struct_init
from kernelgen.references.expressions import evaluate
from kernelgen.specs.expressions import (
    FLOAT32_MAX,
    MAX_TREE_NODES,
    Expression,
    ModInput,
    Node,
    inputs_from_arrays,
    parse_expression,
    parse_mask_mod,
    parse_score_mod,
    verify_tree,
)
from kernelgen.specs.forward import spec_from_dict

# ---- emitted source is linear in the expression ----


def nested_chain(levels: int, base: str = "q_idx") -> str:
    """``where(0 <= X <= 1, 1, 0)`` around itself ``levels`` times: each level's chain has the
    level below as its middle operand."""
    text = base
    for _ in range(levels):
        text = f"where(0 <= {text} <= 1, 1, 0)"
    return text


def test_nested_chained_comparisons_emit_linear_source():
    """22 levels (516 characters) used to emit 180 MB; now each level adds a few lines."""
    sizes = {}
    for levels in (0, 11, 22):
        expression = parse_mask_mod(nested_chain(levels) + " == 0")
        start = time.perf_counter()
        source = expression_source(expression)
        assert time.perf_counter() - start < 1.0
        sizes[levels] = len(source)
    assert sizes[22] < 10_000
    per_level = (sizes[22] - sizes[0]) / 22
    assert per_level < 200
    assert abs((sizes[22] - sizes[11]) - (sizes[11] - sizes[0])) < 0.1 * sizes[22]


def test_a_chains_middle_operand_is_written_once():
    source = expression_source(parse_mask_mod("0 <= abs(q_idx - kv_idx) * 3 < 128"))
    assert source.count("kg_abs_i64(q_idx - kv_idx)") == 1
    assert "const long long kg_v0 = kg_abs_i64(q_idx - kv_idx) * 3LL;" in source
    assert "return (0LL <= kg_v0) && (kg_v0 < 128LL);" in source


LONG = ModInput("n" * 32, "float32", 4)  # the longest name, the most indices
WORST_UNITS = [  # (kind, joiner, unit, end): the longest spellings per node
    ("score_mod", " + ", f"{LONG.name}[b, h, q_idx, kv_idx]", ""),
    ("mask_mod", " < ", f"min({LONG.name}[b, h, q_idx, kv_idx], 1)", ""),
    ("mask_mod", " < ", f"-{LONG.name}[-b, -h, -q_idx, -kv_idx]", ""),
    ("score_mod", " + ", "max(b, h, q_idx, kv_idx, 1, 2, 3, 4.5)", ""),
    ("mask_mod", " <= ", "1.5 + q_idx", " == 1"),
]


def _largest(kind: str, joiner: str, unit: str, end: str) -> Expression:
    """The longest repetition of ``unit`` that the parser accepts."""
    best = None
    for count in range(2, 400):
        try:
            best = parse_expression(kind, joiner.join([unit] * count) + end, [LONG])
        except SpecError:
            if best is not None:
                return best
    raise AssertionError("no repetition parsed")


@pytest.mark.parametrize("unit", WORST_UNITS, ids=range(len(WORST_UNITS)))
def test_expressions_within_the_limits_stay_far_below_the_emitted_size_cap(unit):
    function = expression_cuda.device_function(_largest(*unit))
    assert len(function) < expression_cuda.MAX_FUNCTION_CHARS / 2


def test_the_deepest_nested_chain_stays_far_below_the_emitted_size_cap():
    levels = max(n for n in range(40) if len(nested_chain(n, "q_idx - kv_idx")) < 2000)
    try:
        expression = parse_mask_mod(nested_chain(levels, "q_idx - kv_idx") + " == 1")
    except SpecError:  # deeper than the nesting limit: the deepest that parses
        levels = max(
            n for n in range(levels) if _parses(nested_chain(n, "q_idx - kv_idx") + " == 1")
        )
        expression = parse_mask_mod(nested_chain(levels, "q_idx - kv_idx") + " == 1")
    assert levels >= 20
    assert len(expression_cuda.device_function(expression)) < 10_000


def _parses(text: str) -> bool:
    try:
        parse_mask_mod(text)
    except SpecError:
        return False
    return True


def test_the_emitted_size_cap_is_a_typed_error(monkeypatch):
    expression = parse_mask_mod(nested_chain(10) + " == 0")
    monkeypatch.setattr(expression_cuda, "MAX_FUNCTION_CHARS", 500)
    with pytest.raises(SpecError, match="more than 500 characters, the most allowed"):
        expression_source(expression)


def test_the_cap_stops_an_emission_that_would_grow_past_it(monkeypatch):
    """Were operands spelled twice again, the 22-level chain would need 180 MB: the cap is
    checked at every node, so it is refused at once instead."""
    monkeypatch.setattr(expression_cuda._Emitter, "bind", lambda self, node, code: code)
    expression = parse_mask_mod(nested_chain(22) + " == 0")
    start = time.perf_counter()
    with pytest.raises(SpecError, match="mask_mod: its CUDA function would hold more than"):
        expression_source(expression)
    assert time.perf_counter() - start < 2.0


def _python_value(text: str, **names: float) -> float:
    """The expression's value by Python itself (float64; chains and where as Python's)."""
    functions = {"where": lambda c, x, y: x if c else y, "abs": abs, "min": min, "max": max}
    return eval(text, {"__builtins__": {}}, {**functions, **names})  # our own text


def nested_mixed(levels: int, bound: str) -> str:
    """Chains whose middle operand is read again in the branches; with ``bound`` a float it is
    compared as an int on one side and as a float on the other."""
    text = "q_idx - kv_idx + h"
    for level in range(levels):
        text = f"where(-{level + 1} <= {text} - kv_idx % 3 < {bound}, {text} * 2 + 1, h - {text})"
    return text


@pytest.mark.emulate
def test_nested_chains_compute_what_python_computes():
    """The emitted functions (bound locals, conversions per use) against Python's float64 value
    of the same text and against the evaluator, for nestings 1 to 3 (g++ via the emulator)."""
    from test_expressions import run_emitted

    shape = (1, 2, 5, 6)
    for levels in (1, 2, 3):
        score = parse_score_mod(nested_mixed(levels, "1.5 + score"))
        mask = parse_mask_mod(nested_mixed(levels, "2 + b") + " > 2")
        out, visible, expected, expected_visible = run_emitted(score, mask, shape, {})
        scores = np.random.default_rng(1).standard_normal(shape).astype(np.float32)
        python = np.empty(shape)
        python_visible = np.empty(shape, bool)
        for b, h, q, k in np.ndindex(shape):
            names = dict(b=b, h=h, q_idx=q, kv_idx=k, score=float(scores[b, h, q, k]))
            python[b, h, q, k] = _python_value(score.text, **names)
            python_visible[b, h, q, k] = _python_value(mask.text, **names)
        np.testing.assert_allclose(expected, python, rtol=1e-12)
        np.testing.assert_allclose(out, python, rtol=1e-6)
        np.testing.assert_array_equal(expected_visible, python_visible)
        np.testing.assert_array_equal(visible, python_visible)
        assert 0 < python_visible.mean() < 1


# ---- only checked trees reach the emitter ----


class _Forged(int):
    """An int that prints as 1 in the canonical text but as code in the C++."""

    def __repr__(self) -> str:
        return "1"

    def __format__(self, spec: str) -> str:
        return 'asm("trap;"), 1'


def _q() -> Node:
    return Node("name", "int", op="q_idx")


def test_dataclasses_replace_cannot_put_an_unchecked_tree_into_cuda():
    parsed = parse_mask_mod("q_idx >= kv_idx")
    forged = Node("compare", "bool", args=(_q(), Node("const", "int", value=_Forged(1))),
                  value=(">=",))  # fmt: skip
    with pytest.raises(SpecError, match="not a checked expression tree"):
        dataclasses.replace(parsed, root=forged)
    with pytest.raises(SpecError, match="mod inputs must be a tuple"):
        dataclasses.replace(parsed, inputs=[ModInput("doc", "int32", 1)])


def test_the_emitter_checks_the_tree_again():
    """Even a tree put into an Expression past its constructor is refused at emit time."""
    for forged in (
        Node("compare", "bool", args=(_q(), Node("const", "int", value=_Forged(1))),
             value=(">=",)),
        Node("call", "bool", op='asm("trap;"); where', args=(Node("const", "bool"),) * 3),
        Node("read", "bool", op="secret", args=(_q(),)),
    ):  # fmt: skip
        expression = parse_mask_mod("q_idx >= kv_idx")
        object.__setattr__(expression, "root", forged)
        with pytest.raises(SpecError, match="not a checked expression tree"):
            expression_source(expression)
    expression = parse_mask_mod("q_idx >= kv_idx")
    object.__setattr__(expression, "inputs", (ModInput("doc", "int32", 1),) * 2)
    with pytest.raises(SpecError, match="declared twice"):
        expression_source(expression)


def _int(value: object) -> Node:
    return Node("const", "int", value=value)


def _float(value: object) -> Node:
    return Node("const", "float", value=value)


class _Str(str):
    pass


DOC = ModInput("doc", "int32", 1)
FORGED_TREES = [  # (kind, root, what the refusal names)
    ("mask_mod", Node("asm", "bool"), "node kind 'asm'"),
    ("mask_mod", Node("compare", "bool", args=(_q(), _int(-1)), value=("<",)), "literal -1"),
    ("mask_mod", Node("compare", "bool", args=(_q(), _int(2**63)), value=("<",)), "literal"),
    ("mask_mod", Node("compare", "bool", args=(_q(), _int(True)), value=("<",)), "literal True"),
    ("mask_mod", Node("compare", "bool", args=(_q(), _int(1.0)), value=("<",)), "literal 1.0"),
    ("mask_mod", Node("compare", "bool", args=(_q(), _float(math.inf)), value=("<",)), "inf"),
    ("mask_mod", Node("compare", "bool", args=(_q(), _float(-0.0)), value=("<",)), "-0.0"),
    ("mask_mod", Node("compare", "bool", args=(_q(), _float(1e39)), value=("<",)), "1e+39"),
    ("mask_mod", Node("compare", "bool", args=(_q(), _q()), value=("<<",)), "malformed"),
    ("mask_mod", Node("compare", "bool", args=(_q(), _q()), value=(_Str("<"),)), "malformed"),
    ("mask_mod", Node("compare", "bool", args=(_q(),), value=()), "malformed"),
    ("mask_mod", Node("compare", "bool", args=(_q(), _q()), value=[">"]), "malformed"),
    ("mask_mod", Node("name", "bool", op="q_idx"), "name 'q_idx' (bool)"),
    ("mask_mod", Node("compare", "bool", args=(Node("name", "float", op="score"), _q()),
                      value=("<",)), "name 'score' (float) is not allowed in mask_mod"),
    ("mask_mod", Node("compare", "bool", args=(Node("name", "int", op="x"), _q()),
                      value=("<",)), "name 'x'"),
    ("mask_mod", Node("compare", "bool", args=(Node("name", "int", op=_Str("b")), _q()),
                      value=("<",)), "wrong type"),
    ("mask_mod", Node("read", "bool", op="keep", args=(_q(),)), "not a declared input"),
    ("mask_mod", Node("compare", "bool", args=(Node("read", "int", op="doc", args=()), _q()),
                      value=("<",)), "1 int index"),
    ("mask_mod", Node("compare", "bool", args=(Node("read", "float", op="doc", args=(_q(),)),
                                               _q()), value=("<",)), "gives int, not float"),
    ("score_mod", Node("binary", "float", op="**", args=(Node("name", "float", op="score"),
                                                         _int(3))), "literal 2"),
    ("score_mod", Node("binary", "float", op="<<", args=(Node("name", "float", op="score"),
                                                         _int(3))), "binary '<<'"),
    ("score_mod", Node("binary", "int", op="/", args=(_q(), _q())), "/ giving int"),
    ("score_mod", Node("call", "float", op="system", args=(_q(),)), "call of 'system'"),
    ("score_mod", Node("call", "float", op="exp", args=(_q(), _q())), "2 argument"),
    ("score_mod", Node("neg", "float", args=(Node("call", "float", op="float",
                                                  args=(_q(),)),)), "conversion to float"),
    ("score_mod", Node("neg", "float", args=(_q(),)), "neg of int giving float"),
    ("score_mod", Node("neg", "float", op="-", args=(Node("name", "float", op="score"),)),
     "no operator"),
    ("score_mod", Node("name", "float", op="score", value=1), "holds a value"),
    ("score_mod", Node("name", "float", op="score", args=[]), "wrong type"),
    ("score_mod", "score", "str is not a Node"),
    ("mask_mod", Node("logic", "bool", op="and", args=(Node("compare", "bool", args=(_q(), _q()),
                                                            value=("<",)),)), "1 operand"),
    ("mask_mod", Node("not", "bool", args=(_q(),)), "not of int"),
    ("mask_mod", Node("call", "bool", op="where", args=(_q(), _q(), _q())), "number condition"),
    ("mask_mod", _q(), "it gives int, not bool"),
    ("mask_mod", Node("compare", "bool", args=(_q(), Node("compare", "bool", args=(_q(), _q()),
                                                          value=("<",))), value=("==",)),
     "'==' of int and bool"),
]  # fmt: skip


@pytest.mark.parametrize(("kind", "root", "named"), FORGED_TREES, ids=range(len(FORGED_TREES)))
def test_verify_tree_refuses_what_the_checker_never_builds(kind, root, named):
    with pytest.raises(SpecError) as info:
        verify_tree(kind, root, (DOC,))
    assert named in str(info.value)


def test_verify_tree_is_bounded_on_trees_that_share_subtrees():
    """60 levels of a node used twice: 2**60 paths, refused after MAX_TREE_NODES visits."""
    node = _q()
    for _ in range(60):
        node = Node("binary", "int", op="+", args=(node, node))
    root = Node("compare", "bool", args=(node, _q()), value=("<",))
    start = time.perf_counter()
    with pytest.raises(SpecError, match=f"more than {MAX_TREE_NODES} nodes"):
        verify_tree("mask_mod", root, ())
    with pytest.raises(SpecError, match=f"more than {MAX_TREE_NODES} nodes"):
        Expression("mask_mod", root, ())  # built by hand: not printed before it is measured
    assert time.perf_counter() - start < 1.0


@pytest.mark.parametrize(
    "text",
    [
        "score * 2",
        "-score ** 2 + (q_idx - kv_idx) // 3 % 2",
        "where(0 <= q_idx - kv_idx < 8.5 != 1, exp(score), max(1, score, 2.5))",
        "q_idx - kv_idx",  # an int score_mod: wrapped in a conversion
        "abs(-0.0) + 0.0 + 3.4028234663852886e+38 * 0 + 9223372036854775807 * 0",
    ],
)
def test_verify_tree_accepts_every_parsed_tree(text):
    parsed = parse_score_mod(text, [DOC])
    verify_tree("score_mod", parsed.root, parsed.inputs)
    assert dataclasses.replace(parsed) == parsed


# ---- kernel parameter names cannot collide ----


def test_input_parameters_are_distinct_for_every_set_of_names():
    inputs = inputs_from_arrays(
        {name: np.zeros((2, 2), np.int32) for name in ("a", "a_shape_0", "a_ptr", "inputs")}
    )
    names = [name for _, name in input_params(inputs)]
    assert len(names) == len(set(names)) == 4 * 5
    assert "mod_inputs" not in names  # the kernels' struct variable
    init = input_struct_init(inputs)
    assert "mod_inputs.a_shape_0_ptr = mod_a_shape_0_ptr;" in init
    assert "mod_inputs.a_shape[0] = mod_a_shape_0;" in init


@pytest.mark.emulate
def test_inputs_named_like_kernel_identifiers_compile_and_run(monkeypatch):
    """mod_inputs named inputs (the kernels' struct variable was mod_inputs), a and a_shape_0
    (a's shape parameter was a_shape_0's pointer): compiled and run in the CPU emulator against
    the float64 reference."""
    from kernelgen.references.attention import naive_attention
    from kernelgen.runtime import host

    # the backend warns once per process: an earlier host call in this worker may have
    monkeypatch.setattr(host, "_WARNED", type(host._WARNED)())

    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal((1, 1, 5, 16)).astype(np.float32) for _ in range(3))
    arrays = {
        "inputs": rng.standard_normal(5).astype(np.float32),
        "a": rng.standard_normal(5).astype(np.float32),
        "a_shape_0": np.array([1, 0, 1, 1, 0], np.int32),
    }
    score_mod = "score + 0.5 * inputs[kv_idx] - a[q_idx]"
    mask_mod = "a_shape_0[kv_idx] == 1 or kv_idx == q_idx"
    declared = inputs_from_arrays(arrays)
    score, mask = parse_score_mod(score_mod, declared), parse_mask_mod(mask_mod, declared)
    with pytest.warns(CPUBackendWarning):  # host arrays: the emulator runs the call
        out = kernelgen.attention(
            q, k, v, score_mod=score_mod, mask_mod=mask_mod, mod_inputs=arrays
        )
    ref, _ = naive_attention(
        q.astype(np.float64),
        k.astype(np.float64),
        v.astype(np.float64),
        score_mod=lambda s, b, h, qi, ki: evaluate(
            score, score=s, b=b, h=h, q_idx=qi, kv_idx=ki, inputs=arrays
        ),
        mask_mod=lambda b, h, qi, ki: evaluate(mask, b=b, h=h, q_idx=qi, kv_idx=ki, inputs=arrays),
    )
    np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-5)


# ---- typed errors naming mod_inputs ----

Q = np.zeros((1, 1, 4, 16), np.float32)


def _attention(**kwargs):
    return kernelgen.attention(Q, Q, Q, **kwargs)


@pytest.mark.parametrize(
    ("mod_inputs", "error", "needle"),
    [
        ({"doc": [1, 2, 3]}, InputTypeError, "mod_inputs['doc'] is list; pass a NumPy"),
        ({"doc": 3}, InputTypeError, "mod_inputs['doc'] is int"),
        ({"bad name": np.zeros(4, np.int32)}, InputError, "mod_inputs: mod input name 'bad nam"),
        ({"q_idx": np.zeros(4, np.int32)}, InputError, "mod_inputs: mod input name 'q_idx' is"),
        ({7: np.zeros(4, np.int32)}, InputError, "mod_inputs: mod input name 7 is not allowed"),
        ({f"x{i}": np.zeros(4, np.int32) for i in range(17)}, InputError, "mod_inputs: 17 mod"),
    ],
)
def test_bad_mod_inputs_are_typed_errors_naming_mod_inputs(mod_inputs, error, needle):
    with pytest.raises(error) as info:
        _attention(mask_mod="q_idx >= kv_idx", mod_inputs=mod_inputs)
    assert needle in str(info.value)
    assert not isinstance(info.value, SpecError)


def test_a_meta_tensor_mod_input_is_a_typed_error():
    torch = pytest.importorskip("torch")
    doc = torch.zeros(4, dtype=torch.int32, device="meta")
    with pytest.raises(
        InputTypeError, match=r"mod_inputs\['doc'\] is a torch tensor on device meta"
    ):
        _attention(mask_mod="doc[kv_idx] == 0", mod_inputs={"doc": doc})


def test_a_block_mask_of_other_mod_inputs_says_how_to_fix_the_call():
    doc = np.zeros((1, 4), np.int32)
    both = {"doc": doc, "bias": np.zeros(4, np.float32)}
    mask = block_mask_reference(
        "doc[b, q_idx] == doc[b, kv_idx]", 1, 1, 4, 4, block_m=16, block_n=16,
        mod_inputs={"doc": doc},
    )  # fmt: skip
    with pytest.raises(InputError) as info:
        _attention(score_mod="score + bias[kv_idx]", block_mask=mask, mod_inputs=both)
    message = str(info.value)
    assert "doc:int32[2]" in message and "bias:float32[1],doc:int32[2]" in message
    assert "build the block mask with the mod_inputs the call passes" in message


def test_an_expression_checked_against_other_inputs_says_how_to_fix_the_call():
    checked = parse_mask_mod("q_idx >= kv_idx", [DOC])
    with pytest.raises(InputError, match="pass the mask_mod as a string"):
        _attention(mask_mod=checked)


# ---- line breaks are whitespace ----


@pytest.mark.parametrize(
    "text",
    [
        "q_idx >=\r kv_idx",
        "q_idx >= kv_idx\r",
        "q_idx >=\r\n  kv_idx  # a comment\r\n",
        "q_idx >=  # a comment ends at the line break\n kv_idx",
        "\n\nq_idx >=\n\n kv_idx\n\n",
        "q_idx >= \\\r\n kv_idx",
    ],
)
def test_line_breaks_are_whitespace(text):
    assert parse_mask_mod(text).hash == parse_mask_mod("q_idx >= kv_idx").hash


def test_line_breaks_keep_error_positions_and_comments_hide_nothing():
    with pytest.raises(SpecError, match=r"name 'x' is not allowed.*\(line 2, column 3\)"):
        parse_mask_mod("q_idx >=\r\n  x")
    with pytest.raises(SpecError, match="is empty"):
        parse_mask_mod("# only a comment\r\n# and another")
    assert parse_mask_mod("q_idx >= kv_idx # or True\n").text == "q_idx >= kv_idx"


# ---- spec integer fields ----


@pytest.mark.parametrize(
    ("field", "value"),
    [("head_dim", "64"), ("block_m", "64"), ("num_warps", "4"), ("stages", "2"),
     ("smem_pad", "4"), ("head_dim", b"64"), ("head_dim", 64.0), ("block_n", True)],
)  # fmt: skip
def test_integer_spec_fields_refuse_strings_floats_and_booleans(field, value):
    data = dict(loop_order="v2", dtype="float16", head_dim=64, block_m=64, block_n=64,
                mma="mma_sync", num_warps=4)  # fmt: skip
    with pytest.raises(SpecError, match=f"{field}=.* is not allowed; use an integer"):
        spec_from_dict({**data, field: value})
    assert spec_from_dict({**data, field: np.int64(getattr(spec_from_dict(data), field))})


# ---- scale ----


def _check(scale):
    info = describe(Q, "q")
    return check_inputs(info, info, info, None, layout="bhsd", scale=scale, spec=None,
                        causal=False)  # fmt: skip


@pytest.mark.parametrize(
    ("scale", "error", "needle"),
    [
        (True, InputTypeError, "scale has type bool"),
        (np.bool_(False), InputTypeError, "scale has type bool"),
        ("0.5", InputTypeError, "scale has type str"),
        (1e39, InputError, "scale=1e+39 is not allowed"),
        (-1e39, InputError, "scale=-1e+39 is not allowed"),
        (3e38, InputError, "|scale| <= 2.359e+38"),
        (float("inf"), InputError, "scale=inf is not allowed"),
        (np.float64(np.nan), InputError, "is not allowed"),
    ],
)
def test_scales_the_kernels_cannot_represent_are_refused(scale, error, needle):
    with pytest.raises(error) as info:
        _check(scale)
    assert needle in str(info.value)


def test_the_largest_scale_is_finite_in_the_kernels_float32():
    log2e = math.log2(math.e)
    assert np.isfinite(np.float32(MAX_SCALE * log2e))
    assert MAX_SCALE * log2e <= FLOAT32_MAX
    assert _check(MAX_SCALE).scale == MAX_SCALE
    assert _check(-MAX_SCALE).scale == -MAX_SCALE
    with pytest.raises(InputError):
        _check(math.nextafter(MAX_SCALE, math.inf) * (1 + 1e-15))
    assert _check(np.float32(0.25)).scale == 0.25
    assert _check(2).scale == 2.0
    assert _check(None).scale == 0.25  # 1 / sqrt(16)


def test_the_call_plan_key_tells_a_boolean_scale_from_one():
    torch = pytest.importorskip("torch")
    q = torch.zeros(1, 1, 4, 16)
    keys = {_call_plan_key(q, q, q, None, None, False, s, None, "bhsd", None) for s in (1, True)}
    assert len(keys) == 2


def test_expression_constructor_keeps_its_public_behaviour():
    """A hand-built tree of a parsed expression's nodes still checks to that expression."""
    parsed = parse_mask_mod("0 <= q_idx - kv_idx < 8")
    assert Expression("mask_mod", parsed.root, ()) == parsed
