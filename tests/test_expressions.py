"""The score_mod / mask_mod language (kernelgen/specs/expressions.py, docs/expressions.md): every
refused construct, types, canonical text and hash, the float64 evaluator against Python's own
arithmetic, the CUDA emitter's output (injection) and, through the CPU emulator, the emitted
device functions against the evaluator."""

from __future__ import annotations

import ast
import hashlib
import math
import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kernelgen.errors import InputError, InputTypeError, SpecError
from kernelgen.kernels.expression_cuda import (
    HELPERS,
    expression_source,
    input_params,
    input_struct_init,
)
from kernelgen.references.expressions import evaluate, evaluate_grid
from kernelgen.specs.expressions import (
    MAX_EXPRESSION_CHARS,
    ModInput,
    inputs_from_arrays,
    parse_mask_mod,
    parse_score_mod,
)

BIAS = ModInput("bias", "float32", 2)
DOC = ModInput("doc", "int32", 2)
INPUTS = (BIAS, DOC)


def rejected(kind: str, text: str, inputs=INPUTS) -> str:
    parse = parse_score_mod if kind == "score_mod" else parse_mask_mod
    with pytest.raises(SpecError) as info:
        parse(text, inputs)
    message = str(info.value)
    assert "\n" not in message  # one line per problem
    return message


# (kind, text, what the message must name)
REFUSED = [
    ("score_mod", "score.real", "attribute access 'score.real'"),
    ("score_mod", "bias.T[0, 0]", "subscript 'bias.T[0, 0]'"),
    ("score_mod", "pow(score, 2)", "call 'pow'"),
    ("score_mod", "__import__('os')", "call '__import__'"),
    ("score_mod", "(lambda: 1)()", "call 'lambda: 1'"),
    ("score_mod", "lambda x: x", "lambda"),
    ("score_mod", "(y := score)", "assignment expression"),
    ("score_mod", "[x for x in b]", "comprehension"),
    ("score_mod", "min(*bias)", "starred"),
    ("score_mod", "max(score, 0, key=abs)", "no keyword arguments"),
    ("score_mod", "'score'", "string"),
    ("score_mod", "b'x'", "bytes"),
    ("score_mod", "f'{score}'", "f-string"),
    ("mask_mod", "True", "boolean literal"),
    ("score_mod", "None", "literal 'None'"),
    ("score_mod", "1e999", "not finite"),
    ("score_mod", "1e39", "not finite in float32"),
    ("score_mod", "2**64", "** is allowed only as **2"),
    ("score_mod", "score ** 3", "** is allowed only as **2"),
    ("score_mod", "score ** 2.0", "** is allowed only as **2"),
    ("score_mod", "9223372036854775808", "exceeds 2**63 - 1"),
    ("score_mod", "score @ score", "'@'"),
    ("score_mod", "q_idx & kv_idx", "'&'"),
    ("score_mod", "q_idx << 1", "'<<'"),
    ("score_mod", "~q_idx", "'~'"),
    ("score_mod", "+score", "'unary +'"),
    ("mask_mod", "q_idx is kv_idx", "'is'"),
    ("mask_mod", "q_idx in doc", "'in'"),
    ("score_mod", "score if q_idx else 0", "where(c, x, y)"),
    ("score_mod", "(score, score)", "tuple"),
    ("score_mod", "[score]", "list"),
    ("score_mod", "{score}", "set"),
    ("score_mod", "{1: score}", "dict"),
    ("score_mod", "bias[0:2, 0]", "slice"),
    ("score_mod", "bias[h]", "takes 1 index(es); input 'bias' has rank 2"),
    ("score_mod", "bias[h, q_idx, kv_idx]", "takes 3 index(es)"),
    ("score_mod", "bias", "has rank 2"),
    ("score_mod", "bias[h, 1.5]", "index '1.5' of 'bias' is float"),
    ("score_mod", "bias[h, score]", "is float, not int"),
    ("score_mod", "score[0]", "only declared inputs"),
    ("score_mod", "foo[0]", "only declared inputs"),
    ("score_mod", "x + 1", "name 'x' is not allowed"),
    ("score_mod", "__global__", "name '__global__' is not allowed"),
    ("score_mod", "exp", "'exp' is a function"),
    ("mask_mod", "score > 0", "'score' is only available in score_mod"),
    ("score_mod", "exp(1, 2)", "exp() takes 1 arguments, not 2"),
    ("score_mod", "min(score)", "takes 2 to 8 arguments"),
    ("score_mod", "where(q_idx < 1, score)", "takes 3 arguments"),
    ("score_mod", "await score", "await"),
    ("score_mod", "score; score", "not an expression"),
    ("score_mod", "import os", "not an expression"),
    ("score_mod", "score +", "not an expression"),
]


@pytest.mark.parametrize(("kind", "text", "named"), REFUSED)
def test_every_construct_outside_the_whitelist_is_a_spec_error_naming_it(kind, text, named):
    message = rejected(kind, text)
    assert named in message
    assert message.startswith(kind)


# A boolean used as a number or a number as a boolean.
TYPE_ERRORS = [
    ("mask_mod", "q_idx - kv_idx", "mask_mod must be boolean"),
    ("score_mod", "q_idx >= kv_idx", "score_mod must be a number"),
    ("score_mod", "score + (q_idx < 3)", "is boolean where '+' needs a number"),
    ("score_mod", "-(q_idx < 3)", "unary '-'"),
    ("score_mod", "exp(q_idx < 3)", "exp()"),
    ("score_mod", "bias[h, q_idx < 3]", "index 'q_idx < 3' of 'bias' is bool, not int"),
    ("mask_mod", "not q_idx", "needs a boolean"),
    ("mask_mod", "q_idx and kv_idx < 1", "'and' needs a boolean"),
    ("mask_mod", "(q_idx < 1) or 1", "'or' needs a boolean"),
    ("mask_mod", "where(q_idx, q_idx, 1)", "is a number where where()'s condition needs"),
    ("mask_mod", "where(q_idx, q_idx < 1, q_idx < 2)", "where()'s condition needs a boolean"),
    ("score_mod", "where(q_idx < 1, q_idx < 2, 3)", "mixes a boolean and a number"),
    ("mask_mod", "(q_idx < 1) < (kv_idx < 1)", "compares numbers, not booleans"),
    ("mask_mod", "(q_idx < 1) == 1", "compares a boolean with a number"),
    ("score_mod", "min(q_idx < 1, 2)", "min() needs a number"),
]


@pytest.mark.parametrize(("kind", "text", "named"), TYPE_ERRORS)
def test_booleans_and_numbers_do_not_mix(kind, text, named):
    assert named in rejected(kind, text)


def test_limits_on_size_nesting_and_characters():
    assert f"at most {MAX_EXPRESSION_CHARS}" in rejected(
        "score_mod", "score" + " + 1" * MAX_EXPRESSION_CHARS
    )
    assert "nests deeper than 64 levels" in rejected("score_mod", "-" * 70 + "score")
    assert "nests deeper" in rejected("score_mod", "+".join(["score"] * 70))
    parse_score_mod("+".join(["score"] * 60))
    assert "too many nested parentheses" in rejected("score_mod", "(" * 300 + "score" + ")" * 300)
    wide = "*".join(["(" + "+".join(["b"] * 16) + ")"] * 40)  # shallow, 1279 parts
    assert "more than 500 parts" in rejected("score_mod", wide)
    assert "character 'é'" in rejected("mask_mod", "q_idx >= kv_idx and 'é' == 'e'")
    assert "character '\\x00'" in rejected("mask_mod", "q_idx >= kv_idx\x00")
    assert "character '\\u200b'" in rejected("mask_mod", "q_idx\u200b >= kv_idx")
    # Python folds some unicode letters onto ASCII names (NFKC); the language refuses them
    assert "printable ASCII" in rejected("mask_mod", "\uff51_idx >= kv_idx")
    assert "is empty" in rejected("mask_mod", "   ")
    with pytest.raises(SpecError, match="must be a string"):
        parse_mask_mod(3)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("name", "dtype", "rank", "named"),
    [
        ("__global__", "float32", 1, "'__global__' is not allowed"),
        ("_bias", "float32", 1, "starting with a letter"),
        ("my__bias", "float32", 1, "without '__'"),
        ("a-b", "float32", 1, "ASCII identifier"),
        ("caf\u00e9", "float32", 1, "ASCII identifier"),
        ("x" * 33, "float32", 1, "at most 32"),
        ("score", "float32", 1, "reserved"),
        ("where", "float32", 1, "reserved"),
        ("q_idx", "int32", 1, "reserved"),
        ("kg_doc", "int32", 1, "reserved"),
        ("lambda", "int32", 1, "reserved"),
        ("bias", "float64", 1, "dtype 'float64' is not allowed"),
        ("bias", "float32", 0, "rank 0 is not allowed"),
        ("bias", "float32", 5, "rank 5"),
        ("bias", "float32", True, "rank True"),
    ],
)
def test_bad_input_declarations(name, dtype, rank, named):
    with pytest.raises(SpecError) as info:
        ModInput(name, dtype, rank)
    assert named in str(info.value)


def test_inputs_are_declared_once_and_must_be_mod_inputs():
    with pytest.raises(SpecError, match="declared twice"):
        parse_mask_mod("q_idx >= kv_idx", [DOC, ModInput("doc", "int64", 1)])
    with pytest.raises(SpecError, match="must be ModInput"):
        parse_mask_mod("q_idx >= kv_idx", [("doc", "int32", 2)])  # type: ignore[list-item]


# ---- canonical text and hash ----

SPELLINGS = [
    # each row: spellings of one expression
    [
        "score + bias[h, q_idx - kv_idx]",
        "score+bias[ h,(q_idx-kv_idx) ]",
        "(score) + bias[h, q_idx - kv_idx]  # bias",
    ],
    [
        "q_idx >= kv_idx and doc[b, q_idx] == doc[b, kv_idx]",
        "(q_idx >= kv_idx) and (doc[b,q_idx]==doc[b,kv_idx])",
    ],
    ["q_idx < 16 and kv_idx < 16 and b < 2", "(q_idx < 16 and kv_idx < 16) and b < 2"],
    [
        "kv_idx <= q_idx + 16",
        "kv_idx <= q_idx + 0x10",
        "kv_idx <= q_idx + 0b10000",
        "kv_idx <= (q_idx + 1_6)",
    ],
    ["score * 0.5", "score * .5", "score * 5e-1", "score\\\n * 0.5"],
    ["-score ** 2", "-(score ** 2)", "-(score) ** 2"],
]


@pytest.mark.parametrize("spellings", SPELLINGS)
def test_spellings_of_one_expression_share_text_and_hash(spellings):
    kind = "score_mod" if "score" in spellings[0] else "mask_mod"
    parse = parse_score_mod if kind == "score_mod" else parse_mask_mod
    parsed = [parse(text, INPUTS) for text in spellings]
    assert len({p.text for p in parsed}) == 1
    assert len({p.hash for p in parsed}) == 1
    assert parsed[0].text == spellings[0].replace("-score ** 2", "-score ** 2")
    # the canonical text parses back to itself
    assert parse(parsed[0].text, INPUTS).text == parsed[0].text
    # the hash is the documented recipe, a function of (kind, text, inputs) alone
    key = f"kernelgen-expression-1\n{kind}\n{parsed[0].text}\nbias:float32[2],doc:int32[2]"
    assert parsed[0].hash == hashlib.sha256(key.encode()).hexdigest()[:12]


def test_the_hash_ignores_declaration_order_and_follows_meaning_and_inputs():
    base = parse_mask_mod("doc[b, q_idx] == doc[b, kv_idx]", INPUTS)
    assert parse_mask_mod("doc[b, q_idx] == doc[b, kv_idx]", INPUTS[::-1]).hash == base.hash
    others = [
        parse_mask_mod("doc[b, q_idx] != doc[b, kv_idx]", INPUTS),
        parse_mask_mod("doc[b, q_idx] == doc[b, kv_idx]", [BIAS, ModInput("doc", "int64", 2)]),
        parse_mask_mod("doc[b, q_idx] == doc[b, kv_idx]", [DOC]),  # bias no longer declared
        parse_mask_mod("doc[b, q_idx] == doc[b, kv_idx]", [*INPUTS, ModInput("z", "bool", 1)]),
        parse_mask_mod("doc[b, kv_idx] == doc[b, q_idx]", INPUTS),
    ]
    assert len({base.hash, *(o.hash for o in others)}) == 1 + len(others)
    # an int 2 and a float 2.0 mean different arithmetic; score_mod and mask_mod differ
    assert parse_score_mod("score * 2").hash != parse_score_mod("score * 2.0").hash
    assert parse_score_mod("q_idx - kv_idx").hash != parse_score_mod("q_idx - kv_idx + 0.0").hash
    assert re.fullmatch(r"[0-9a-f]{12}", base.hash)


def test_canonical_text_keeps_needed_parentheses():
    cases = {
        "score - (score - 1)": "score - (score - 1)",
        "(score - score) - 1": "score - score - 1",
        "score / (q_idx * 2)": "score / (q_idx * 2)",
        "(-score) ** 2": "(-score) ** 2",
        "-(-score)": "-(-score)",
        "where(not (q_idx < 1 or b < 1), score, 0)": "where(not (q_idx < 1 or b < 1), score, 0)",
        "where((q_idx < 1) == (b < 1), score, 0)": "where((q_idx < 1) == (b < 1), score, 0)",
        "where(h < 1 and (b < 1 or h < 2), 1, 0)": "where(h < 1 and (b < 1 or h < 2), 1, 0)",
    }
    for text, canonical in cases.items():
        parsed = parse_score_mod(text)
        assert parsed.text == canonical
        assert parse_score_mod(parsed.text).hash == parsed.hash


# ---- the evaluator against Python's own arithmetic ----

PY_FUNCTIONS = {
    "where": lambda c, x, y: x if c else y,
    "min": min,
    "max": max,
    "abs": abs,
    "exp": math.exp,
    "log": lambda x: math.log(x) if x > 0 else (-math.inf if x == 0 else math.nan),
    "tanh": math.tanh,
    "sqrt": lambda x: math.sqrt(x) if x >= 0 else math.nan,
}
# Integer and float expressions whose Python value is the language's (no zero divisors).
PYTHON_SEMANTICS = [
    "(q_idx - kv_idx) // 3 + (q_idx - kv_idx) % 4 * 10",
    "(q_idx - 7) // -3 - (kv_idx - 5) % -4",
    "(q_idx - kv_idx) / 4 + abs(q_idx - 2 * kv_idx) - (h + 1) ** 2",
    "min(q_idx, kv_idx, 3) * 1000 + max(q_idx - 5, kv_idx - 2)",
    "where(q_idx % 2 == 0 and not kv_idx > 3 or b == 1, q_idx * 0.25, -kv_idx)",
    "exp(-(q_idx - kv_idx) ** 2 / 8) + tanh(score) + sqrt(q_idx + 1) + log(kv_idx + 1)",
    "(q_idx - kv_idx) * 1.5 // 2 + (q_idx - kv_idx) * 1.5 % 2",
    "where(0 < q_idx - kv_idx <= 3, score, 0)",
]


@pytest.mark.parametrize("text", PYTHON_SEMANTICS)
def test_the_evaluator_computes_what_python_computes(text):
    parsed = parse_score_mod(text)
    batch, heads, sq, sk = 2, 2, 9, 11
    rng = np.random.default_rng(0)
    score = rng.standard_normal((batch, heads, sq, sk))
    values = evaluate_grid(parsed, batch, heads, sq, sk, score=score)
    for index in np.ndindex(batch, heads, sq, sk):
        names = dict(zip(("b", "h", "q_idx", "kv_idx"), index, strict=True))
        expected = eval(
            text, {"__builtins__": {}}, {**PY_FUNCTIONS, **names, "score": score[index]}
        )
        assert values[index] == pytest.approx(float(expected), rel=1e-14, abs=1e-14), index


def test_integer_division_by_zero_gives_zero_and_reads_outside_an_input_give_zero():
    parsed = parse_score_mod("q_idx // (kv_idx - 2) + 100 * (q_idx % (kv_idx - 2))")
    values = evaluate_grid(parsed, 1, 1, 5, 5, score=np.zeros((1, 1, 5, 5)))
    assert (values[0, 0, :, 2] == 0).all()
    assert values[0, 0, 4, 0] == 4 // -2 + 100 * (4 % -2)
    bias = np.arange(6, dtype=np.float32).reshape(2, 3)
    parsed = parse_score_mod("bias[h, q_idx - kv_idx]", [BIAS, DOC])
    doc = np.zeros((1, 1), dtype=np.int32)
    values = evaluate_grid(parsed, 1, 2, 4, 4, score=0.0, inputs={"bias": bias, "doc": doc})
    for h, q, k in np.ndindex(2, 4, 4):
        expected = bias[h, q - k] if 0 <= q - k < 3 else 0.0
        assert values[0, h, q, k] == expected


def test_the_evaluator_checks_its_input_arrays():
    parsed = parse_mask_mod("doc[b, q_idx] == doc[b, kv_idx]", [DOC])
    with pytest.raises(InputError, match="missing: doc"):
        evaluate_grid(parsed, 1, 1, 2, 2)
    with pytest.raises(InputTypeError, match="dtype int64; declared int32"):
        evaluate_grid(parsed, 1, 1, 2, 2, inputs={"doc": np.zeros((1, 2), dtype=np.int64)})
    with pytest.raises(InputError, match="declared rank 2"):
        evaluate_grid(parsed, 1, 1, 2, 2, inputs={"doc": np.zeros(2, dtype=np.int32)})
    with pytest.raises(InputError, match="not declared: x"):
        evaluate(
            parsed, b=0, h=0, q_idx=0, kv_idx=0, inputs={"doc": np.zeros((1, 2), np.int32), "x": 1}
        )
    assert inputs_from_arrays({"doc": np.zeros((1, 2), np.int32)}) == (DOC,)


# ---- the CUDA emitter ----

CXX_WORDS = {
    # what the emitter and its fixed helpers may spell, besides numbers and punctuation
    "__device__",
    "__forceinline__",
    "long",
    "float",
    "bool",
    "const",
    "return",
    "if",
    "struct",
    "static_cast",
    "unsigned",
    "ULL",
    "void",
    "in",
    "score",
    "b",
    "h",
    "q_idx",
    "kv_idx",
    "x",
    "y",
    "q",
    "r",
    "floorf",
    "fabsf",
    "expf",
    "logf",
    "tanhf",
    "sqrtf",
    "false",
    "KgModInputs",
    "kg_floordiv_i64",
    "kg_floordiv_f32",
    "kg_mod_i64",
    "kg_mod_f32",
    "kg_square_i64",
    "kg_square_f32",
    "kg_min_i64",
    "kg_min_f32",
    "kg_max_i64",
    "kg_max_f32",
    "kg_abs_i64",
    "kg_score_mod",
    "kg_mask_mod",
    "ifndef",
    "define",
    "endif",
    "KG_EXPRESSION_HELPERS",
    "int",
    "__half",
    "__nv_bfloat16",
    "__half2float",
    "__bfloat162float",
}


def code_words(source: str, inputs) -> set[str]:
    """Identifiers outside comments, minus those the ABI derives from declared input names."""
    code = "\n".join(line.split("//")[0] for line in source.splitlines())
    words = set(re.findall(r"[A-Za-z_][A-Za-z_0-9]*", code))
    derived = {f"{i.name}_{part}" for i in inputs for part in ("ptr", "shape", "stride")}
    derived |= {f"kg_read_{i.name}" for i in inputs} | {f"i{d}" for d in range(4)}
    return words - derived - {"LL", "f"} - {w for w in words if re.fullmatch(r"e\d*", w)}


# (text, accepted): accepted texts lose their comments and continuations; the rest is refused
INJECTIONS = [
    ("q_idx >= kv_idx  # */ __global__ void evil() {} \n#define q_idx 0", True),
    ("q_idx >= kv_idx \\\n and kv_idx >= 0", True),
    ("(q_idx >= kv_idx  # \\\n)", True),
    ('q_idx >= kv_idx and doc[b, q_idx] == doc[b, kv_idx]  # "); system("rm', True),
    ("q_idx >= kv_idx and '#define' == '#define'", False),
    ("q_idx >= kv_idx and '*/ __global__' != ''", False),
    ("q_idx >= kv_idx  # caf\u00e9 */", False),
    ("q_idx >= kv_idx\n# \u2028 */", False),
    ("__global__ == kv_idx", False),
    ("q_idx >= kv_idx and __import__('os').system('x') == 0", False),
    ("q_idx >= kv_idx and doc[b, q_idx].__class__ == 1", False),
]


@pytest.mark.parametrize(("text", "accepted"), INJECTIONS)
def test_nothing_of_the_user_text_reaches_cuda_but_checked_tokens(text, accepted):
    if not accepted:
        with pytest.raises(SpecError):
            parse_mask_mod(text, INPUTS)
        return
    parsed = parse_mask_mod(text, INPUTS)
    source = expression_source(parsed)
    assert code_words(source, INPUTS) <= CXX_WORDS
    for bad in ("evil", "__global__", "system", "\\", "*/", "/*", '"', "#define q"):
        assert bad not in source
    # the comment above the function holds the canonical text only
    assert f"// mask_mod {parsed.hash}: {parsed.text}\n" in source


def test_generated_identifiers_come_from_tables_and_checked_names():
    inputs = [
        ModInput("rel", "bfloat16", 3),
        ModInput("keep", "bool", 2),
        ModInput("int", "int64", 1),
    ]
    score = parse_score_mod("score + rel[b, h, q_idx - kv_idx] * int[h]", inputs)
    mask = parse_mask_mod("keep[q_idx, kv_idx] or q_idx == kv_idx", inputs)
    source = expression_source(score, mask)
    assert code_words(source, score.inputs) <= CXX_WORDS
    assert "const long long* int_ptr;" in source  # an input named like a C++ keyword is fine
    assert source.startswith(HELPERS)
    assert input_params(score.inputs)[:3] == [
        ("const long long*", "mod_int_ptr"),
        ("long long", "mod_int_shape_0"),
        ("long long", "mod_int_stride_0"),
    ]
    assert "mod_inputs.rel_stride[2] = mod_rel_stride_2;" in input_struct_init(score.inputs)
    with pytest.raises(SpecError, match="same mod inputs"):
        expression_source(score, parse_mask_mod("q_idx >= kv_idx"))


# ---- the emitted device functions, compiled by g++ through the CPU emulator ----

GRID_KERNEL = """{source}
// One thread per (b, h, q_idx, kv_idx): score_mod of scores[i] and mask_mod, row-major.
extern "C" __global__ void expression_grid(const float* scores, float* score_out,
                                           int* mask_out, int batch, int heads, int seqlen_q,
                                           int seqlen_k{params}) {{
  const long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= static_cast<long long>(batch) * heads * seqlen_q * seqlen_k) return;
  const long long kv_idx = i % seqlen_k, q_idx = i / seqlen_k % seqlen_q;
  const long long h = i / (static_cast<long long>(seqlen_k) * seqlen_q) % heads;
  const long long b = i / (static_cast<long long>(seqlen_k) * seqlen_q * heads);
  {init}
  score_out[i] = kg_score_mod(scores[i], b, h, q_idx, kv_idx, mod_inputs);
  mask_out[i] = kg_mask_mod(b, h, q_idx, kv_idx, mod_inputs) ? 1 : 0;
}}
"""


def input_arguments(declared, arrays) -> list:
    """The flattened mod-input arguments (pointer, shape, strides in elements) of ``arrays``."""
    args = []
    for spec in declared:
        array = arrays[spec.name]
        args.append(array.view(np.uint16) if spec.dtype == "bfloat16" else array)
        args += list(array.shape)
        args += [s // array.itemsize for s in array.strides]
    return args


def run_emitted(score, mask, shape, arrays):
    from kernelgen.emulator import build_kernel

    params = [("const float*", "scores"), ("float*", "score_out"), ("int*", "mask_out")]
    params += [("int", n) for n in ("batch", "heads", "seqlen_q", "seqlen_k")]
    extra = input_params(score.inputs)
    source = GRID_KERNEL.format(
        source="".join(f"#include <{h}>\n" for h in ("cuda_fp16.h", "cuda_bf16.h"))
        + expression_source(score, mask),
        params="".join(f", {ctype} {name}" for ctype, name in extra),
        init=input_struct_init(score.inputs).replace("\n", "\n  "),
    )
    kernel = build_kernel(source, "expression_grid", params + extra)
    rng = np.random.default_rng(1)
    scores = rng.standard_normal(shape).astype(np.float32)
    score_out = np.full(shape, np.nan, dtype=np.float32)
    mask_out = np.full(shape, -1, dtype=np.int32)
    total = int(np.prod(shape))
    kernel(
        grid=-(-total // 128),
        block=128,
        shared_mem=0,
        args=[scores, score_out, mask_out, *shape, *input_arguments(score.inputs, arrays)],
    )
    expected_score = evaluate_grid(score, *shape, score=scores.astype(np.float64), inputs=arrays)
    expected_mask = evaluate_grid(mask, *shape, inputs=arrays)
    return score_out, mask_out.astype(bool), expected_score, expected_mask


@pytest.mark.emulate
def test_emitted_integer_semantics_equal_the_evaluator():
    """Floor division and modulo of negative ints (C truncates), zero divisors, min/max/abs,
    chains, where, squares: exact."""
    score = parse_score_mod(
        "(q_idx - kv_idx) // 3 + 100 * ((q_idx - kv_idx) % 4) + 10000 * ((kv_idx - 5) // -2)"
        " + 1000000 * ((q_idx - 3) % -5) + 7 * (q_idx // (kv_idx - 4)) + (h - q_idx) ** 2"
        " + min(q_idx, kv_idx, 4) - max(b, kv_idx - q_idx) + abs(q_idx - 2 * kv_idx)"
    )
    mask = parse_mask_mod(
        "(q_idx - kv_idx) % 3 == 1 or 0 <= kv_idx - q_idx < 2 or not q_idx % (kv_idx - 3) != 2"
    )
    shape = (2, 2, 9, 11)
    out, visible, expected, expected_visible = run_emitted(score, mask, shape, {})
    np.testing.assert_array_equal(out, expected.astype(np.float32))
    np.testing.assert_array_equal(visible, expected_visible)
    assert 0 < expected_visible.mean() < 1


@pytest.mark.emulate
def test_emitted_float_functions_and_every_input_dtype_equal_the_evaluator():
    """fp32 against float64: exp/log/tanh/sqrt, float // and %, mixed int/float, where; inputs of
    every dtype, read through strides (a transposed view, a broadcast stride of 0) and outside
    their bounds (reads 0)."""
    inputs = [
        ModInput("rel", "float32", 2),
        ModInput("gain", "float16", 1),
        ModInput("shift", "bfloat16", 2),
        ModInput("doc", "int32", 2),
        ModInput("pos", "int64", 1),
        ModInput("keep", "bool", 2),
    ]
    score = parse_score_mod(
        "where(q_idx >= kv_idx, score * gain[h] + rel[h, q_idx - kv_idx + 3], "
        "tanh(score) * 2.5 + shift[kv_idx, b] - sqrt(kv_idx + 0.5)) "
        "+ exp(-abs(score)) + log(1 + q_idx * q_idx) + score * 1.5 // 0.7 + (score * 3) % 1.25 "
        "+ (q_idx - kv_idx) / 4 + pos[kv_idx] * 0.125",
        inputs,
    )
    mask = parse_mask_mod(
        "doc[b, q_idx] == doc[b, kv_idx] and (keep[h, kv_idx] or pos[kv_idx] >= q_idx) "
        "or rel[h, q_idx - kv_idx + 3] > 0.5",
        inputs,
    )
    rng = np.random.default_rng(2)
    shape = (2, 2, 7, 9)
    shift = rng.standard_normal((2, 9)).astype(np.float32).astype(_bf16()).T  # strides (2, 18)
    arrays = {
        "rel": rng.standard_normal((2, 8)).astype(np.float32),  # q - k + 3 leaves [0, 8)
        "gain": np.broadcast_to(np.float16(0.75), (2,)),  # stride 0
        "shift": shift,
        "doc": np.repeat(np.array([[0, 0, 0, 1, 1, 2, 2, 2, 2]], dtype=np.int32), 2, axis=0),
        "pos": rng.integers(-3, 9, size=9).astype(np.int64),
        "keep": rng.random((2, 9)) < 0.3,
    }
    out, visible, expected, expected_visible = run_emitted(score, mask, shape, arrays)
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(visible, expected_visible)
    assert 0 < expected_visible.mean() < 1


def _bf16():
    return pytest.importorskip("ml_dtypes").bfloat16


# ---- docs/expressions.md shows what the emitter writes ----

DOC_EXAMPLES = [
    ("mask_mod", "doc[b, q_idx] == doc[b, kv_idx]", [ModInput("doc", "int32", 2)]),
    ("score_mod", "score + bias[h, q_idx - kv_idx + 1024]", [ModInput("bias", "float32", 2)]),
    ("mask_mod", "(q_idx - kv_idx) // 64 == 0 and q_idx >= kv_idx", []),
]
DOC_TABLE = [
    ("mask_mod", "kv_idx < prefix[b] or kv_idx <= q_idx", [ModInput("prefix", "int32", 1)]),
    ("mask_mod", "anc[b, q_idx, kv_idx]", [ModInput("anc", "bool", 3)]),
    ("mask_mod", "abs(q_idx - kv_idx) <= width[h]", [ModInput("width", "int32", 1)]),
    ("score_mod", "30.0 * tanh(score / 30.0)", []),
    ("mask_mod", "kv_idx <= q_idx + 1024", []),
]


def test_the_docs_show_the_emitted_functions_and_valid_examples():
    from conftest import ROOT

    from kernelgen.kernels.expression_cuda import device_function, input_struct
    from kernelgen.specs.expressions import parse_expression

    text = (ROOT / "docs" / "expressions.md").read_text()
    for kind, expression, inputs in DOC_EXAMPLES:
        parsed = parse_expression(kind, expression, inputs)
        assert device_function(parsed) in text + "\n"
        if inputs and kind == "mask_mod":
            assert input_struct(parsed.inputs) in text
    for kind, expression, inputs in DOC_TABLE:
        assert f"`{parse_expression(kind, expression, inputs).text}`" in text


# ---- random expressions: the evaluator against Python, the emitted C++ against the evaluator ----


class RandomExpressions:
    """Random int-valued and boolean expressions over the index names (every construct of the
    language but floats and inputs), small enough never to overflow int64."""

    def __init__(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)

    def pick(self, options):
        return options[self.rng.integers(len(options))]

    def leaf(self) -> str:
        if self.rng.random() < 0.4:
            return str(int(self.rng.integers(-9, 10)))
        name = self.pick(["b", "h", "q_idx", "kv_idx", "q_idx", "kv_idx"])
        return f"{name} ** 2" if self.rng.random() < 0.1 else name

    def number(self, depth: int) -> str:
        if depth == 0 or self.rng.random() < 0.2:
            return self.leaf()
        x, y = self.number(depth - 1), self.number(depth - 1)
        form = self.pick(
            ["({x} + {y})", "({x} - {y})", "({x} * {y})", "({x} // {y})", "({x} % {y})",
             "-({x})", "abs({x})", "min({x}, {y})", "max({x}, {y}, {z})",
             "where({c}, {x}, {y})"]
        )  # fmt: skip
        return form.format(x=x, y=y, z=self.leaf(), c=self.boolean(depth - 1))

    def boolean(self, depth: int) -> str:
        x, y = self.number(max(depth - 1, 0)), self.number(max(depth - 1, 0))
        if depth == 0 or self.rng.random() < 0.4:
            op = self.pick(["<", "<=", ">", ">=", "==", "!="])
            return f"({x} {op} {y})" if self.rng.random() < 0.8 else f"({x} < {y} <= {x} + 5)"
        p, q = self.boolean(depth - 1), self.boolean(depth - 1)
        return self.pick([f"({p} and {q})", f"({p} or {q})", f"(not {p})", f"({p} == {q})"])


class Int(int):
    """A Python int whose // and % follow the language's zero-divisor rule (0)."""

    def __floordiv__(self, other):
        return Int(0 if other == 0 else int(self) // int(other))

    def __mod__(self, other):
        return Int(0 if other == 0 else int(self) % int(other))


def _int_method(name: str):
    def method(self, *args):
        return Int(getattr(int, name)(int(self), *(int(a) for a in args)))

    return method


for _name in ("__add__", "__sub__", "__mul__", "__neg__", "__abs__", "__pow__"):
    setattr(Int, _name, _int_method(_name))


class _IntLiterals(ast.NodeTransformer):
    def visit_Constant(self, node: ast.Constant) -> ast.AST:
        if type(node.value) is not int:
            return node
        return ast.Call(ast.Name("Int", ast.Load()), [node], [])


def python_value(text: str, names: dict) -> object:
    """Python's value of ``text`` with every int an :class:`Int`."""
    tree = ast.fix_missing_locations(_IntLiterals().visit(ast.parse(text, mode="eval")))
    scope = {**PY_FUNCTIONS, "Int": Int, **{k: Int(v) for k, v in names.items()}}
    return eval(compile(tree, "<expression>", "eval"), {"__builtins__": {}}, scope)


def test_random_expressions_evaluate_as_python_computes_them():
    generate = RandomExpressions(seed=11)
    for _ in range(40):
        text = generate.number(3)
        parsed = parse_score_mod(text)
        assert parse_score_mod(parsed.text).hash == parsed.hash
        values = evaluate_grid(parsed, 2, 2, 5, 6, score=0.0)
        for index in np.ndindex(values.shape):
            names = dict(zip(("b", "h", "q_idx", "kv_idx"), index, strict=True))
            assert values[index] == python_value(text, names), (text, index)


MANY_KERNEL = """{source}
extern "C" __global__ void many_expressions(float* score_out, int* mask_out, int count,
                                            int total, int heads, int seqlen_q, int seqlen_k) {{
  const long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= total) return;
  const long long kv_idx = i % seqlen_k, q_idx = i / seqlen_k % seqlen_q;
  const long long h = i / (static_cast<long long>(seqlen_k) * seqlen_q) % heads;
  const long long b = i / (static_cast<long long>(seqlen_k) * seqlen_q * heads);
  KgModInputs mod_inputs;
{calls}
}}
"""


@pytest.mark.emulate
def test_random_emitted_expressions_equal_the_evaluator():
    """24 random score_mod / mask_mod pairs in one source (one g++ build), exact."""
    from kernelgen.emulator import build_kernel
    from kernelgen.kernels.expression_cuda import device_function

    generate = RandomExpressions(seed=12)
    pairs = [
        (parse_score_mod(generate.number(3)), parse_mask_mod(generate.boolean(3)))
        for _ in range(24)
    ]
    functions, calls = [], []
    for n, (score, mask) in enumerate(pairs):
        functions.append(device_function(score).replace("kg_score_mod(", f"kg_score_mod_{n}("))
        functions.append(device_function(mask).replace("kg_mask_mod(", f"kg_mask_mod_{n}("))
        calls.append(
            f"  score_out[{n} * total + i] = kg_score_mod_{n}(0.0f, b, h, q_idx, kv_idx, "
            f"mod_inputs);\n  mask_out[{n} * total + i] = kg_mask_mod_{n}(b, h, q_idx, kv_idx, "
            "mod_inputs);"
        )
    source = MANY_KERNEL.format(
        source=HELPERS + "struct KgModInputs {};\n" + "\n".join(functions), calls="\n".join(calls)
    )
    params = [("float*", "score_out"), ("int*", "mask_out")]
    params += [("int", n) for n in ("count", "total", "heads", "seqlen_q", "seqlen_k")]
    kernel = build_kernel(source, "many_expressions", params)
    shape = (2, 2, 6, 7)
    total = int(np.prod(shape))
    score_out = np.full((len(pairs), *shape), np.nan, dtype=np.float32)
    mask_out = np.full((len(pairs), *shape), -1, dtype=np.int32)
    kernel(
        grid=-(-total // 128),
        block=128,
        shared_mem=0,
        args=[score_out, mask_out, len(pairs), total, *shape[1:]],
    )
    for n, (score, mask) in enumerate(pairs):
        expected = evaluate_grid(score, *shape, score=0.0).astype(np.float32)
        np.testing.assert_array_equal(score_out[n], expected, score.text)
        np.testing.assert_array_equal(mask_out[n], evaluate_grid(mask, *shape), mask.text)


TOKENS = [
    "score", "b", "h", "q_idx", "kv_idx", "bias", "doc", "x", "__global__", "where", "min",
    "exp", "(", ")", "[", "]", ",", ".", ":", ";", "+", "-", "*", "/", "//", "%", "**", "2",
    "0x1f", "1e9", "1.5", "1e400", "<", "<=", "==", "!=", "and", "or", "not", "if", "else",
    "lambda", ":=", "'s'", "#", "\\\n", "\n", " ", "*/", "/*", "\\", "\"", "{", "}", "@", "~",
]  # fmt: skip


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(TOKENS), max_size=25), st.sampled_from(["score_mod", "mask_mod"]))
def test_any_text_is_an_expression_or_a_spec_error(tokens, kind):
    """Token soup: the checker either refuses it with a SpecError or accepts it, and then the
    emitted source holds only the emitter's words and the canonical text parses back."""
    from kernelgen.specs.expressions import parse_expression

    text = "".join(tokens)
    try:
        parsed = parse_expression(kind, text, INPUTS)
    except SpecError as exc:
        assert str(exc).startswith(kind) and "\n" not in str(exc)
        return
    assert code_words(expression_source(parsed), INPUTS) <= CXX_WORDS
    assert parse_expression(kind, parsed.text, INPUTS).hash == parsed.hash


def test_hand_built_trees_are_checked_again():
    """An Expression built around a forged tree keeps only what its canonical text checks to
    (tests/test_security_expressions.py: the trees are verified again at emission)."""
    from kernelgen.specs.expressions import Expression, Node

    forged_read = Node("read", "int", op='doc); system("x', args=(Node("name", "int", op="b"),))
    forged_name = Node("name", "int", op="__global__")
    forged_kind = Node("asm", "bool")
    for root in (forged_read, forged_name, forged_kind):
        with pytest.raises(SpecError):
            Expression("mask_mod", Node("compare", "bool", args=(root, root), value=("==",)), ())
    typed_wrong = Node("const", "bool", value=1)  # an int claiming to be a boolean
    with pytest.raises(SpecError, match="mask_mod must be boolean"):
        Expression("mask_mod", typed_wrong, ())
    rebuilt = Expression("mask_mod", parse_mask_mod("q_idx >= kv_idx").root, ())
    assert rebuilt == parse_mask_mod("q_idx >= kv_idx")


def test_only_parentheses_around_a_whole_argument_are_dropped():
    from kernelgen.kernels.expression_cuda import _bare

    assert _bare("(a + b)") == "a + b"
    assert _bare("((a) + (b))") == "(a) + (b)"
    assert _bare("(a) + (b)") == "(a) + (b)"
    assert _bare("f(a)") == "f(a)"
    parsed = parse_score_mod("exp((score - 1) * (score + 1)) / (q_idx - (kv_idx - 1))")
    assert "expf((score - 1.0f) * (score + 1.0f)) / " in expression_source(parsed)
