"""d(score_mod)/d(score) (kernelgen/specs/expression_grad.py): the symbolic derivative against
central finite differences of the float64 evaluator, its conventions at kinks, the constructs it
refuses, and kg_score_mod_grad compiled by g++ through the CPU emulator."""

from __future__ import annotations

import numpy as np
import pytest

from kernelgen.errors import InputError, SpecError
from kernelgen.kernels.expression_cuda import (
    device_function,
    expression_source,
    input_params,
    input_struct_init,
    score_mod_grad_source,
)
from kernelgen.references.expressions import evaluate
from kernelgen.specs.expression_grad import score_mod_derivative, score_mod_grad_callable
from kernelgen.specs.expressions import (
    ModInput,
    Node,
    derived_expression,
    parse_mask_mod,
    parse_score_mod,
)

BIAS = (ModInput("bias", "float32", 2),)
HEADS, SEQ = 3, 12


def _bias(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"bias": rng.standard_normal((HEADS, 2 * SEQ)).astype(np.float32)}


DIFFERENTIABLE = [
    "score + bias[h, q_idx - kv_idx + 12]",
    "score * 0.5",
    "tanh(score / 30) * 30",
    "where(q_idx >= kv_idx, score, score * 2)",
    "max(score, 0.0)",
    "exp(score) / 10",
    "score * score",
    "log(abs(score) + 1)",
    "sqrt(score * score + 1)",
    "score * bias[h, kv_idx] - (score - q_idx) ** 2 / (1 + kv_idx)",
    "30.0 * tanh(log(1 + exp(score)) / 30.0)",
    "min(score, 2.0 * score - 1, q_idx * 0.25, max(-score, bias[h, q_idx]))",
    "where(score > 1.0, sqrt(score), 1 / (2 - score)) + h * score - 3 * score",
    "score / (1 + exp(-score)) + abs(score - q_idx) * -score",
    "-(score ** 2) + min(h, score) / max(score * score, 0.5, kv_idx)",
    "where(score % 2.0 > 1.0, exp(-abs(score)), tanh(score) * bias[h, 0]) + q_idx // 2",
]


def _points(seed: int, count: int = 400) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "score": rng.uniform(-4.0, 4.0, count),
        "b": rng.integers(0, 2, count),
        "h": rng.integers(0, HEADS, count),
        "q_idx": rng.integers(0, SEQ, count),
        "kv_idx": rng.integers(0, SEQ, count),
    }


@pytest.mark.parametrize("text", DIFFERENTIABLE)
def test_derivative_matches_central_differences(text):
    """At random scores and indices away from kinks and jumps (where the one-sided differences
    disagree), the derivative equals central differences of the expression to ~1e-8."""
    score_mod = parse_score_mod(text, BIAS)
    arrays = _bias()
    p = _points(seed=len(text))
    indices = {k: p[k] for k in ("b", "h", "q_idx", "kv_idx")}

    def f(score):
        return evaluate(score_mod, score=score, inputs=arrays, **indices)

    s, step, coarse = p["score"], 1e-5, 1e-3
    central = (f(s + step) - f(s - step)) / (2 * step)
    right = (f(s + coarse) - f(s)) / coarse
    left = (f(s) - f(s - coarse)) / coarse
    smooth = np.abs(right - left) < 0.02 + 0.02 * np.abs(central)
    assert smooth.mean() > 0.8, "most points lie away from the kinks"
    grad = score_mod_grad_callable(score_mod, arrays)
    derivative = grad(s, indices["b"], indices["h"], indices["q_idx"], indices["kv_idx"])
    np.testing.assert_allclose(derivative[smooth], central[smooth], rtol=1e-7, atol=1e-8)


class RandomFloatExpressions:
    """Random differentiable score_mods: every float construct but // and % (the smooth ones in
    forms that keep values and slopes moderate), over score, the indices and a float input."""

    def __init__(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)

    def pick(self, options: list[str]) -> str:
        return options[self.rng.integers(len(options))]

    def leaf(self) -> str:
        return self.pick(
            ["score", "score", "score", "score", "0.5", "2", "q_idx", "h", "bias[h, kv_idx]"]
        )

    def number(self, depth: int) -> str:
        if depth == 0 or self.rng.random() < 0.15:
            return self.leaf()
        x, y, z = self.number(depth - 1), self.number(depth - 1), self.leaf()
        form = self.pick(
            ["({x} + {y})", "({x} - {y})", "({x} * {y})", "({x} / (1 + ({y}) ** 2))", "-({x})",
             "abs({x})", "min({x}, {y})", "max({x}, {y}, {z})", "where({x} > {z}, {x}, {y})",
             "exp(tanh({x}))", "tanh({x})", "log(abs({x}) + 1)", "sqrt(({x}) ** 2 + 1)",
             "({x}) ** 2", "where({x} > {z}, 1, q_idx) * {y}"]
        )  # fmt: skip
        return form.format(x=x, y=y, z=z)


def test_random_derivatives_match_central_differences():
    """60 random expressions of depth 3 against central differences, away from kinks."""
    generate = RandomFloatExpressions(seed=3)
    arrays = _bias()
    checked = 0
    for n in range(60):
        score_mod = parse_score_mod(generate.number(3), BIAS)
        p = _points(seed=n, count=50)
        indices = {k: p[k] for k in ("b", "h", "q_idx", "kv_idx")}

        def f(score, score_mod=score_mod, indices=indices):
            return evaluate(score_mod, score=score, inputs=arrays, **indices)

        s = p["score"]
        central = (f(s + 1e-6) - f(s - 1e-6)) / 2e-6
        right, left = (f(s + 1e-4) - f(s)) / 1e-4, (f(s) - f(s - 1e-4)) / 1e-4
        smooth = np.abs(right - left) < 1e-2 * (1 + np.abs(central))
        derivative = score_mod_grad_callable(score_mod, arrays)(s, *indices.values())
        scale = 1 + np.abs(central)
        np.testing.assert_array_less(
            (np.abs(derivative - central) / scale)[smooth], 1e-6, score_mod.text
        )
        checked += int(smooth.sum())
        assert parse_score_mod(score_mod_derivative(score_mod).text, BIAS) is not None
    assert checked > 0.8 * 60 * 50


@pytest.mark.parametrize("text", DIFFERENTIABLE)
def test_derivative_is_a_checked_canonical_score_mod(text):
    """The same kind and inputs, deterministic text, and a tree equal to what its text parses
    to; other spellings of the expression give the same derivative."""
    score_mod = parse_score_mod(text, BIAS)
    derivative = score_mod_derivative(score_mod)
    assert derivative.kind == "score_mod"
    assert derivative.inputs == score_mod.inputs
    assert score_mod_derivative(parse_score_mod(f"(({text}))  # again", BIAS)) == derivative
    assert parse_score_mod(derivative.text, BIAS).root == derivative.root
    assert "kg_score_mod(" in device_function(derivative)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("score + bias[h, q_idx - kv_idx + 12]", "1.0"),
        ("score * 0.5", "0.5"),
        ("3 * score", "3.0"),
        ("score ** 2", "2.0 * score"),
        ("score * h", "1.0 * h"),
        ("where(q_idx >= kv_idx, score, score * 2)", "where(q_idx >= kv_idx, 1.0, 2.0)"),
        ("max(score, 0.0)", "where(0.0 > score, 0.0, 1.0)"),
        ("min(score, 1.0, q_idx)",
         "where(q_idx < min(score, 1.0), 0.0, where(1.0 < score, 0.0, 1.0))"),
        ("exp(score) / 10", "exp(score) / 10"),
        ("tanh(score / 30) * 30", "(1.0 - tanh(score / 30) ** 2) * (1.0 / 30) * 30"),
        ("abs(score)", "where(score > 0.0, 1.0, where(score < 0.0, -1.0, 0.0))"),
        ("1 / score", "-(1 / score) / score"),
    ],
)  # fmt: skip
def test_derivative_text(text, expected):
    """0 and 1 fold away; the rest is the chain rule as written by hand."""
    assert score_mod_derivative(parse_score_mod(text, BIAS)).text == expected


@pytest.mark.parametrize(
    "text", ["q_idx - kv_idx", "bias[h, q_idx] * 2 + h", "where(q_idx > 3, 1.5, b)", "2.5"]
)
def test_derivative_of_an_expression_without_score_is_zero(text):
    derivative = score_mod_derivative(parse_score_mod(text, BIAS))
    assert derivative.text == "0.0"
    grad = score_mod_grad_callable(parse_score_mod(text, BIAS), _bias())
    np.testing.assert_array_equal(grad(np.linspace(-3, 3, 7), 0, 1, 2, 3), 0.0)


@pytest.mark.parametrize(
    ("text", "score", "expected"),
    [
        ("max(score, 0.0)", 0.0, 1.0),  # a tie selects the first argument
        ("max(0.0, score)", 0.0, 0.0),
        ("min(score, 1.0)", 1.0, 1.0),
        ("min(2.0, score * 2, score + 1)", 1.0, 0.0),
        ("min(3.0, score * 2, score + 1)", 1.0, 2.0),
        ("abs(score)", 0.0, 0.0),  # sign(0) = 0
        ("abs(score)", -2.0, -1.0),
        ("where(score >= 0.0, score * 3, score)", 0.0, 3.0),  # the branch where selects
    ],
)
def test_derivative_at_kinks_follows_the_selected_branch(text, score, expected):
    grad = score_mod_grad_callable(parse_score_mod(text))
    assert grad(score, 0, 0, 0, 0) == expected


@pytest.mark.parametrize(
    ("text", "where"),
    [
        ("score // 2", "score // 2"),
        ("(score * 3) % 1.25 + 1", "score * 3 % 1.25"),
        ("where(q_idx > 0, exp(score // 1.0), score)", "score // 1.0"),
        ("q_idx + (score + 1) // 4.0", "(score + 1) // 4.0"),
    ],
)
def test_floor_division_and_modulo_of_the_score_are_refused(text, where):
    with pytest.raises(InputError, match="derivative with respect to score") as caught:
        score_mod_derivative(parse_score_mod(text, BIAS))
    assert where in str(caught.value)
    assert "not defined" in str(caught.value)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("score * ((q_idx - kv_idx) // 4 % 3)", "1.0 * ((q_idx - kv_idx) // 4 % 3)"),
        ("abs(h + where(score > 2.0, 2, h))", "0.0"),  # an int: piecewise constant
        ("where(score > 0.0, 1.5, 2.5) // 1.0 + score", "1.0"),
        ("score * (where(score > 0.0, 3, 4) % 2)", "1.0 * (where(score > 0.0, 3, 4) % 2)"),
    ],
)
def test_piecewise_constant_parts_have_derivative_zero(text, expected):
    """Ints (score at most in a where's condition) and // or % of piecewise constant floats."""
    assert score_mod_derivative(parse_score_mod(text)).text == expected


def test_derived_expressions_are_verified():
    with pytest.raises(SpecError, match="not a checked expression tree"):
        derived_expression("score_mod", Node("name", "float", op="evil"), ())
    with pytest.raises(SpecError, match="not a checked expression tree"):
        derived_expression("score_mod", Node("const", "float", value=-1.0), ())


def test_only_a_checked_score_mod_has_a_derivative():
    with pytest.raises(InputError, match="score_mod"):
        score_mod_derivative(parse_mask_mod("q_idx >= kv_idx"))
    with pytest.raises(InputError, match="score_mod"):
        score_mod_derivative("score * 2")  # type: ignore[arg-type]


def test_a_derivative_beyond_the_tree_limits_is_an_input_error():
    nested = "tanh(" * 40 + "score" + ")" * 40  # the derivative holds 40 nested products
    with pytest.raises(InputError, match="too large"):
        score_mod_derivative(parse_score_mod(nested))


def test_grad_callable_checks_its_inputs():
    with pytest.raises(InputError, match="missing: bias"):
        score_mod_grad_callable(parse_score_mod("score * bias[h, 0]", BIAS), {})


# ---- CUDA ----


def _signature(source: str, name: str) -> str:
    start = source.index(f" {name}(")
    return source[start + len(name) + 1 : source.index(")", start)]


def test_grad_source_has_the_signature_of_kg_score_mod():
    score_mod = parse_score_mod("score * bias[h, kv_idx] + tanh(score)", BIAS)
    grad = score_mod_grad_source(score_mod)
    forward = device_function(score_mod)
    assert "kg_score_mod_grad(" in grad and "kg_score_mod(" not in grad
    assert _signature(grad, "kg_score_mod_grad") == _signature(forward, "kg_score_mod")
    assert score_mod.hash in grad.splitlines()[0]
    assert score_mod_derivative(score_mod).text in grad


def test_device_function_names_are_a_fixed_table():
    score_mod = parse_score_mod("score * 2")
    assert device_function(score_mod) == device_function(score_mod, "kg_score_mod")
    with pytest.raises(SpecError, match="not allowed"):
        device_function(score_mod, "evil(){}")
    with pytest.raises(SpecError, match="not allowed"):
        device_function(parse_mask_mod("q_idx > 0"), "kg_score_mod_grad")
    with pytest.raises(InputError, match="not defined"):
        score_mod_grad_source(parse_score_mod("score // 2"))


GRAD_KERNEL = """{source}
// One thread per point: kg_score_mod_grad_<n> of every expression at (scores[i], b, h, q, kv).
extern "C" __global__ void score_mod_grads(const float* scores, const int* idx, float* out,
                                           int count{params}) {{
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= count) return;
  const long long b = idx[4 * i], h = idx[4 * i + 1], q_idx = idx[4 * i + 2];
  const long long kv_idx = idx[4 * i + 3];
  {init}
{calls}
}}
"""
EMULATED = [
    "score + bias[h, q_idx - kv_idx + 12]",
    "tanh(score / 30) * 30",
    "where(q_idx >= kv_idx, max(score, 0.0), score * score) * bias[h, kv_idx]",
    "log(abs(score) + 1) + sqrt(score * score + 1) - exp(score) / 10 + h * score",
    "min(score, 2.0 * score - 1, q_idx * 0.25) / (1 + exp(-score))",
]


GRAD_PARAMS = [("const float*", "scores"), ("const int*", "idx"), ("float*", "out")]
GRAD_PARAMS += [("int", "count"), *input_params(BIAS)]


def grad_kernel_source(score_mods: list) -> str:
    """One kernel calling each expression's kg_score_mod_grad (renamed _<n>) at every point."""
    functions = [
        score_mod_grad_source(e).replace("kg_score_mod_grad(", f"kg_score_mod_grad_{n}(")
        for n, e in enumerate(score_mods)
    ]
    calls = [
        f"  out[{n} * count + i] = kg_score_mod_grad_{n}(scores[i], b, h, q_idx, kv_idx, "
        "mod_inputs);"
        for n in range(len(score_mods))
    ]
    return GRAD_KERNEL.format(
        source=expression_source(score_mods[0]) + "\n".join(functions),
        params="".join(f", {ctype} {name}" for ctype, name in input_params(BIAS)),
        init=input_struct_init(BIAS).replace("\n", "\n  "),
        calls="\n".join(calls),
    )


@pytest.mark.compile
def test_emitted_grad_compiles_with_nvrtc():
    from conftest import require_toolchain

    from kernelgen.kernels.compile import compile_offline, nvrtc_available

    require_toolchain(nvrtc_available(), "NVRTC (cuda-bindings, nvidia-cuda-nvrtc, headers)")
    source = grad_kernel_source([parse_score_mod(text, BIAS) for text in EMULATED])
    compiled = compile_offline(source, "score_mod_grads", "sm_80")
    assert compiled.resources.spill_store_bytes == compiled.resources.stack_bytes == 0


@pytest.mark.emulate
def test_emitted_grad_equals_the_float64_derivative():
    """kg_score_mod_grad of five expressions over a float32 input, compiled in one g++ build,
    against the float64 derivative at the same fp32 scores: fp32 accuracy."""
    from kernelgen.emulator import build_kernel

    score_mods = [parse_score_mod(text, BIAS) for text in EMULATED]
    kernel = build_kernel(grad_kernel_source(score_mods), "score_mod_grads", GRAD_PARAMS)
    p = _points(seed=5, count=300)
    magnitude = np.abs(p["score"]) + 0.05  # away from the kinks at 0 (and their fp32 rounding)
    scores = (np.sign(p["score"]) * magnitude).astype(np.float32)
    idx = np.stack([p["b"], p["h"], p["q_idx"], p["kv_idx"]], axis=1).astype(np.int32)
    bias = _bias()["bias"]
    out = np.full((len(score_mods), len(scores)), np.nan, dtype=np.float32)
    kernel(
        grid=-(-len(scores) // 128),
        block=128,
        shared_mem=0,
        args=[scores, idx, out, len(scores), bias, *bias.shape, *(s // 4 for s in bias.strides)],
    )
    for n, score_mod in enumerate(score_mods):
        grad = score_mod_grad_callable(score_mod, {"bias": bias})
        expected = grad(scores.astype(np.float64), *idx.T)
        np.testing.assert_allclose(out[n], expected, rtol=2e-5, atol=2e-5, err_msg=EMULATED[n])
