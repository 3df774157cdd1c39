"""Emulation tier: user expressions (``score_mod``, ``mask_mod``, ``mod_inputs``) and block masks
through ``torch.ops.kernelgen.attention`` and its backward operator (kernelgen.torch_ops,
kernelgen.calls.op_expressions): a compiled training step (fullgraph) on CPU tensors, forward
and gradients against float64 (the expressions' NumPy evaluator), and bad calls failing when
traced. Every test reuses the same expressions and shapes, so the emulator builds few kernels."""

from __future__ import annotations

import dataclasses
import functools
import re

import numpy as np
import pytest

torch = pytest.importorskip("torch")
kt = pytest.importorskip("kernelgen.torch_ops")

import kernelgen  # noqa: E402
from kernelgen.errors import InputError, InputTypeError  # noqa: E402
from kernelgen.references import attention as reference  # noqa: E402
from kernelgen.references.attention import (  # noqa: E402
    LSE_TOLERANCE,
    OUT_TOLERANCE,
    relative_error,
)
from kernelgen.references.expressions import evaluate  # noqa: E402
from kernelgen.specs.expression_grad import score_mod_grad_callable  # noqa: E402
from kernelgen.specs.expressions import (  # noqa: E402
    inputs_from_arrays,
    parse_mask_mod,
    parse_score_mod,
)

pytestmark = [
    pytest.mark.emulate,
    pytest.mark.filterwarnings("ignore::kernelgen.errors.CPUBackendWarning"),
]

SCORE_MOD = "score + bias[h, q_idx, kv_idx]"
MASK_MOD = "doc[b, q_idx] == doc[b, kv_idx]"
# (B, H, Hkv, S, D) per case; documents of 16, 20 and 12 tokens give the block mask (16 x 16
# tiles) fully visible, partly visible and hidden tiles
SHAPES = {"score_mod": (1, 2, 1, 24, 16), "mask_mod": (1, 2, 1, 24, 16),
          "block_mask": (1, 2, 1, 48, 16)}  # fmt: skip
DOCS = {24: [0] * 10 + [1] * 14, 48: [0] * 16 + [1] * 20 + [2] * 12}
DTYPES = {"score_mod": torch.float32, "mask_mod": torch.float32, "block_mask": torch.float16}


def problem(kind, seed=0):
    """q, k, v (requiring grad), dout, and the mod inputs of ``kind``'s call."""
    batch, heads, kv_heads, seqlen, head_dim = SHAPES[kind]
    g = torch.Generator().manual_seed(seed)
    q = torch.randn((batch, heads, seqlen, head_dim), generator=g)
    k, v = (torch.randn((batch, kv_heads, seqlen, head_dim), generator=g) for _ in range(2))
    dout = torch.randn(q.shape, generator=g)
    q, k, v, dout = (x.to(DTYPES[kind]) for x in (q, k, v, dout))
    if kind == "score_mod":
        inputs = {"bias": torch.randn((heads, seqlen, seqlen), generator=g)}
    else:
        inputs = {"doc": torch.tensor([DOCS[seqlen]], dtype=torch.int32)}
    return q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), dout, inputs


def expression_keywords(kind, inputs):
    """kt.attention's keywords for ``kind``, and the reference's hooks (float64 evaluator)."""
    arrays = {n: x.numpy() for n, x in inputs.items()}
    declared = inputs_from_arrays(arrays)
    if kind == "score_mod":
        expression = parse_score_mod(SCORE_MOD, declared)
        hooks = {
            "score_mod": lambda s, b, h, q, k: evaluate(
                expression, score=s, b=b, h=h, q_idx=q, kv_idx=k, inputs=arrays
            ),
            "score_mod_grad": score_mod_grad_callable(expression, arrays),
        }
        return {"score_mod": SCORE_MOD}, hooks
    expression = parse_mask_mod(MASK_MOD, declared)
    hooks = {
        "mask_mod": lambda b, h, q, k: evaluate(
            expression, b=b, h=h, q_idx=q, kv_idx=k, inputs=arrays
        )
    }
    if kind == "mask_mod":
        return {"mask_mod": MASK_MOD}, hooks
    seqlen = SHAPES[kind][3]
    blocks = kernelgen.block_mask(
        MASK_MOD, 1, 1, seqlen, seqlen, block_m=16, block_n=16, mod_inputs=inputs
    )
    assert set(np.unique(blocks.tile_states())) == {0, 1, 2}  # hidden, partial and full tiles
    return {"block_mask": blocks}, hooks


def host(x):
    return x.detach().double().numpy()


@pytest.mark.parametrize("kind", ["score_mod", "mask_mod", "block_mask"])
def test_a_compiled_training_step_takes_expressions_and_block_masks(kind):
    """torch.compile(fullgraph=True) traces the operator and its backward with a score_mod, a
    mask_mod, or a block mask (passed as the compiled function's argument): out, lse, dq, dk
    and dv against float64; the mod inputs get no gradient."""
    q, k, v, dout, inputs = problem(kind)
    keywords, hooks = expression_keywords(kind, inputs)
    blocks = keywords.pop("block_mask", None)
    mod_input = next(iter(inputs.values()))
    if mod_input.is_floating_point():
        mod_input.requires_grad_()

    def step(q, k, v, mod_input, blocks):
        out, lse = kt.attention(
            q * 1.0, k, v, mod_inputs={next(iter(inputs)): mod_input}, block_mask=blocks,
            return_lse=True, **keywords,
        )  # fmt: skip
        return (out * dout).sum(), out, lse

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    loss, out, lse = compiled(q, k, v, mod_input, blocks)
    grads = torch.autograd.grad(loss, (q, k, v))
    assert mod_input.grad is None
    dtype = "float32" if DTYPES[kind] == torch.float32 else "float16"
    forward_hooks = {n: hook for n, hook in hooks.items() if n != "score_mod_grad"}
    want_out, want_lse = reference.naive_attention(host(q), host(k), host(v), **forward_hooks)
    assert relative_error(host(out), want_out) <= OUT_TOLERANCE[dtype]
    assert np.max(np.abs(lse.numpy() - want_lse)) <= LSE_TOLERANCE
    want = reference.attention_backward(*(host(x) for x in (dout, q, k, v)), **hooks)
    for name, got in zip(("dq", "dk", "dv"), grads, strict=True):
        assert got.shape == getattr(want, name).shape and got.dtype == q.dtype
        error = relative_error(host(got), getattr(want, name))
        assert error <= OUT_TOLERANCE[dtype], f"{name}: relative error {error:.3g}"


def test_a_dynamic_compile_takes_block_masks_of_each_length():
    """torch.compile(dynamic=True): symbolic sizes reach the wrapper, which reads the block
    mask's expression signature (made when the mask was built: formatting a symbolic int there
    failed to trace). Two lengths, each with its own block mask, forward and dq against
    float64."""
    step = torch.compile(
        lambda q, k, v, doc, blocks: kt.attention(
            q, k, v, mod_inputs={"doc": doc}, block_mask=blocks
        ),
        fullgraph=True,
        dynamic=True,
        backend="aot_eager",
    )
    for seqlen in (48, 64):
        g = torch.Generator().manual_seed(seqlen)
        q, k, v = (
            torch.randn((1, heads, seqlen, 16), generator=g).half().requires_grad_()
            for heads in (2, 1, 1)
        )
        doc = torch.tensor([[3 * i // seqlen for i in range(seqlen)]], dtype=torch.int32)
        blocks = kernelgen.block_mask(
            MASK_MOD, 1, 1, seqlen, seqlen, block_m=16, block_n=16, mod_inputs={"doc": doc}
        )
        out = step(q, k, v, doc, blocks)
        dout = torch.randn(q.shape, generator=g).half()
        (dq,) = torch.autograd.grad((out * dout).sum(), (q,))
        d = doc.numpy()
        hooks = {"mask_mod": lambda b, h, i, j, d=d: d[b, i] == d[b, j]}
        want, _ = reference.naive_attention(host(q), host(k), host(v), **hooks)
        assert relative_error(host(out), want) <= OUT_TOLERANCE["float16"]
        grads = reference.attention_backward(*(host(x) for x in (dout, q, k, v)), **hooks)
        assert relative_error(host(dq), grads.dq) <= OUT_TOLERANCE["float16"]


def test_the_operators_with_expressions_pass_torch_library_checks():
    """Schema, fake implementation and autograd registration with a score_mod, a mask_mod and
    their tensor list of mod inputs (torch.library.opcheck), forward and backward."""
    q, k, v, dout, inputs = problem("mask_mod", seed=1)
    bias = torch.randn((2, 24, 24), generator=torch.Generator().manual_seed(2))
    expressions = (SCORE_MOD, MASK_MOD, [bias, inputs["doc"]], "bias,doc")
    forward = (q, k, v, None, False, None, "bhsd", None, None, None, None, None, None, False,
               None, None, None, *expressions)  # fmt: skip
    torch.library.opcheck(
        torch.ops.kernelgen.attention.default,
        forward,
        test_utils=("test_schema", "test_autograd_registration", "test_faketensor"),
    )
    out, lse = torch.ops.kernelgen.attention(*forward)
    backward = (dout, q.detach(), k.detach(), v.detach(), out.detach(), lse, None, False, None,
                "bhsd", None, None, None, None, False, *expressions)  # fmt: skip
    torch.library.opcheck(
        torch.ops.kernelgen.attention_backward.default,
        backward,
        test_utils=("test_schema", "test_faketensor"),
    )


def test_the_module_docstring_gives_the_schemas():
    """The module docstring's schema text is the registered schemas'."""
    text = " ".join(kt.__doc__.split())
    for op in (torch.ops.kernelgen.attention, torch.ops.kernelgen.attention_backward):
        assert str(op.default._schema) in text


# ---- bad calls fail when traced ----------------------------------------------------------------


@functools.cache
def bad_calls():
    """(name, q, k, v, keywords, error, message): calls kernelgen's checks refuse (built when
    a test first asks: the block masks run the builder)."""
    q, k, v, _, inputs = problem("block_mask", seed=3)
    q, k, v = (x.detach() for x in (q, k, v))
    blocks = kernelgen.block_mask(MASK_MOD, 1, 1, 48, 48, block_m=16, block_n=16, mod_inputs=inputs)
    short = (x[:, :, :32] for x in (q, k, v))
    bias = torch.zeros((2, 48, 48))
    cut = dataclasses.replace(blocks, partial_indices=blocks.partial_indices[..., :2])
    numpy_mask = kernelgen.block_mask(
        MASK_MOD, 1, 1, 48, 48, block_m=16, block_n=16, mod_inputs={"doc": inputs["doc"].numpy()}
    )
    return [
        ("an expression reads a name mod_inputs lacks", q, k, v,
         {"score_mod": SCORE_MOD, "mod_inputs": {"bias2": bias}}, InputError,
         "only declared inputs (bias2) can be indexed"),
        ("a block mask of another sequence length", *short,
         {"block_mask": blocks, "mod_inputs": inputs}, InputError,
         "block_mask does not fit the call: it was built for seqlen_q 48 (the call has 32)"),
        ("a block mask list of the wrong shape", q, k, v,
         {"block_mask": cut, "mod_inputs": inputs}, InputError,
         "block_mask.partial_indices has shape (1, 1, 3, 2); expected (1, 1, 3, 3)"),
        ("a block mask built with other mod inputs", q, k, v,
         {"block_mask": blocks, "mod_inputs": {**inputs, "bias": bias}}, InputError,
         "block_mask's mask_mod was checked against mod inputs doc:int32[2] but the call's "
         "mod_inputs are bias:float32[3],doc:int32[2]"),
        ("a block mask of NumPy lists", q, k, v,
         {"block_mask": numpy_mask, "mod_inputs": inputs}, InputTypeError,
         "block_mask.partial_counts is a ndarray; torch.ops.kernelgen.attention takes torch "
         "tensors"),
    ]  # fmt: skip


BAD_CALLS = ("an expression reads a name mod_inputs lacks", "a block mask of another sequence "
             "length", "a block mask list of the wrong shape", "a block mask built with other "
             "mod inputs", "a block mask of NumPy lists")  # fmt: skip


@pytest.mark.parametrize("index", range(len(BAD_CALLS)), ids=BAD_CALLS)
def test_bad_expression_calls_raise_typed_errors_when_traced(index):
    """The fake implementation (FakeTensorMode: what torch.compile runs, nothing is launched)
    raises kernelgen's typed error naming the argument."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    name, q, k, v, keywords, error, message = bad_calls()[index]
    assert name == BAD_CALLS[index]
    with (
        FakeTensorMode(allow_non_fake_inputs=True) as mode,
        pytest.raises(error, match=re.escape(message)),
    ):
        kt.attention(*(mode.from_tensor(x) for x in (q, k, v)), **keywords)


class Attention(torch.nn.Module):
    """kt.attention with fixed keywords (a BlockMask is no pytree: held, not passed)."""

    def __init__(self, **keywords):
        super().__init__()
        self.keywords = keywords

    def forward(self, q, k, v):
        return kt.attention(q, k, v, **self.keywords)


def test_a_bad_block_mask_fails_when_exported():
    """torch.export traces with fake tensors and runs nothing: the fake's checks raise the
    typed error's text (wrapped by the tracer)."""
    _, q, k, v, keywords, _, message = bad_calls()[1]
    with pytest.raises(Exception, match=re.escape(message)):
        torch.export.export(Attention(**keywords), (q, k, v))


def test_torch_export_holds_the_expressions_in_the_graph():
    """An exported program calls the operator with the expression's text and the mod input's
    name as constants; run, it gives the eager operator's result."""
    q, k, v, _, inputs = problem("score_mod", seed=6)
    q, k, v = (x.detach() for x in (q, k, v))
    module = Attention(score_mod=SCORE_MOD, mod_inputs=inputs)
    exported = torch.export.export(module, (q, k, v))
    calls = [n for n in exported.graph.nodes if n.target == torch.ops.kernelgen.attention.default]
    assert len(calls) == 1
    assert [a for a in calls[0].args if isinstance(a, str)] == ["bhsd", SCORE_MOD, "bias"]
    torch.testing.assert_close(exported.module()(q, k, v), module(q, k, v), rtol=0, atol=0)


def test_operator_arguments_that_do_not_fit_raise_input_errors():
    """The schema's own values (names joined by commas, the block mask's pieces together) are
    checked where the operator rebuilds kernelgen's keywords, naming the argument."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    q, k, v, _, inputs = problem("mask_mod", seed=4)
    doc = inputs["doc"]
    base = (q.detach(), k.detach(), v.detach(), None, False, None, "bhsd", None, None, None,
            None, None, None, False, None, None, None)  # fmt: skip
    bad = {
        "mod_input_names='doc,x' names 2 arrays but mod_inputs holds 1": (
            None, MASK_MOD, [doc], "doc,x", None, None, None, None),
        "mod_input_names='doc,doc' names 'doc' twice": (
            None, MASK_MOD, [doc, doc], "doc,doc", None, None, None, None),
        "mod_inputs given without mod_input_names": (
            None, MASK_MOD, [doc], None, None, None, None, None),
        "block_mask holds 1 values; expected 4": (
            None, MASK_MOD, [doc], "doc", [doc], [24, 24, 16, 16], MASK_MOD, "doc:int32[2]"),
        "block_mask_inputs='doc:int9[2]'": (
            None, MASK_MOD, [doc], "doc", [doc] * 4, [24, 24, 16, 16], MASK_MOD, "doc:int9[2]"),
        "block_mask, block_mask_sizes given without block_mask_mod, block_mask_inputs": (
            None, MASK_MOD, [doc], "doc", [doc] * 4, [24, 24, 16, 16], None, None),
    }  # fmt: skip
    with FakeTensorMode(allow_non_fake_inputs=True):
        for message, expressions in bad.items():
            with pytest.raises(InputError, match=re.escape(message)):
                torch.ops.kernelgen.attention(*base, *expressions)


def test_a_score_mod_without_a_derivative_fails_when_traced_for_training():
    """A score_mod the backward cannot differentiate (floor division of the score) raises
    InputError naming it when a compiled training step traces the call, before any kernel
    runs."""
    q, k, v, _, _ = problem("score_mod", seed=5)
    step = torch.compile(
        lambda q, k, v: kt.attention(q, k, v, score_mod="score // 2"), fullgraph=True,
        backend="aot_eager",
    )  # fmt: skip
    message = "score_mod 'score // 2': its derivative with respect to score"
    with pytest.raises(Exception, match=re.escape(message)):
        step(q, k, v)


def test_fp8_calls_take_expressions_when_traced():
    """fp8 q, k, v with a mask_mod trace to a bfloat16 out (the fp8 forward takes expressions);
    a block mask in tiles the fp8 kernel does not take fails when traced (fake tensors only:
    nothing runs)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    if not hasattr(torch, "float8_e4m3fn"):
        pytest.skip("this torch has no float8_e4m3fn")
    q = torch.zeros((1, 2, 48, 128)).to(torch.float8_e4m3fn)
    inputs = {"doc": torch.tensor([DOCS[48]], dtype=torch.int32)}
    blocks = kernelgen.block_mask(MASK_MOD, 1, 1, 48, 48, block_m=16, block_n=16, mod_inputs=inputs)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake = mode.from_tensor(q)
        out, lse = kt.attention(
            fake, fake, fake, mask_mod=MASK_MOD, mod_inputs=inputs, return_lse=True
        )
        assert out.dtype == torch.bfloat16 and out.shape == q.shape and lse.shape == (1, 2, 48)
        with pytest.raises(InputError, match=re.escape("block_mask has 16 x 16 tiles")):
            kt.attention(fake, fake, fake, block_mask=blocks, mod_inputs=inputs)


def test_a_training_loop_derives_its_block_masks_lists_once(monkeypatch):
    """Two eager training steps with the same block mask: the operators get back the BlockMask
    of the first call (its pieces unchanged), so the backward builds the key tiles' query-tile
    lists once, and both steps' gradients match; an in-place write to a list (its version
    counter moves) gives a new BlockMask."""
    from kernelgen.calls import backward_mask, op_expressions

    q, k, v, dout, inputs = problem("block_mask", seed=6)
    keywords, _ = expression_keywords("block_mask", inputs)
    built = []
    tile_lists = backward_mask.tile_lists
    monkeypatch.setattr(
        backward_mask, "tile_lists", lambda *a, **kw: built.append(kw) or tile_lists(*a, **kw)
    )
    monkeypatch.setattr(op_expressions, "_BLOCK_MASKS", type(op_expressions._BLOCK_MASKS)())

    def step():
        out = kt.attention(q, k, v, mod_inputs=inputs, **keywords)
        return torch.autograd.grad((out * dout).sum(), (q, k, v))

    first, second = step(), step()
    assert len(built) == 1 and built[0]["transposed"]
    for a, b in zip(first, second, strict=True):
        assert torch.equal(a, b)
    assert len(op_expressions._BLOCK_MASKS) == 1
    (cached,) = op_expressions._BLOCK_MASKS.values()
    values = op_expressions.op_values(None, None, None, keywords["block_mask"], torch.Tensor)
    assert op_expressions.call_keywords(*values, reuse=True)["block_mask"] is cached
    assert op_expressions.call_keywords(*values)["block_mask"] is not cached
    values[4][0].add_(0)  # an in-place write: the partial counts' version moves
    assert op_expressions.call_keywords(*values, reuse=True)["block_mask"] is not cached
