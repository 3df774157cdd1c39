"""Emulation tier: ``torch.ops.kernelgen.attention`` (kernelgen.torch_ops), a torch custom
operator with a fake implementation, traced by ``torch.compile(fullgraph=True)`` and run on CPU
tensors through the CPU backend, against float64."""

from __future__ import annotations

import numpy as np
import pytest
from attention_cases import Case, assert_matches, example_variants, make_case

torch = pytest.importorskip("torch")
kt = pytest.importorskip("kernelgen.torch_ops")

import kernelgen  # noqa: E402

pytestmark = [
    pytest.mark.emulate,
    pytest.mark.filterwarnings("ignore::kernelgen.errors.CPUBackendWarning"),
]


def test_the_operator_passes_torch_library_checks():
    """Schema, fake implementation and eager results agree (torch.library.opcheck)."""
    data = make_case(Case(1, 2, 1, 8, 12), "float32", 16, True, seed=1)
    q, k, v = (torch.from_numpy(getattr(data, n)) for n in "qkv")
    args = (q, k, v, None, True, None, "bhsd", None, None, None, None, None, None)
    torch.library.opcheck(
        torch.ops.kernelgen.attention.default,
        args,
        test_utils=("test_schema", "test_faketensor"),
    )


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_torch_compile_fullgraph_traces_through_the_operator(layout):
    """A compiled function around the operator (GQA, causal, a mask, the LSE, torch ops before
    and after) gives float64's results; fake shapes hold for both layouts."""
    data = make_case(Case(2, 4, 2, 12, 20, mask="full"), "float32", 16, True, seed=2)
    q, k, v, mask = (torch.from_numpy(getattr(data, n)) for n in ("q", "k", "v", "mask"))
    if layout == "bshd":
        q, k, v = (x.transpose(1, 2) for x in (q, k, v))

    def fn(q, k, v, mask):
        out, lse = kt.attention(
            q * 1.0, k, v, causal=True, mask=mask, layout=layout, return_lse=True
        )
        return out + 0.0, lse

    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    out, lse = compiled(q, k, v, mask)
    assert out.shape == q.shape and lse.shape == (2, 4, 12) and lse.dtype == torch.float32
    got = out.numpy() if layout == "bhsd" else out.transpose(1, 2).numpy()
    assert_matches(got.astype(np.float64), lse.numpy(), data, "float32")


def test_the_operator_takes_the_variants():
    """window_size, softcap, ALiBi slopes and sinks through the operator, compiled and eager,
    against float64 (docs/variants.md)."""
    case = Case(1, 2, 1, 9, 20)
    variants = example_variants(("window", "softcap", "alibi", "sinks"), 1, 2, 3, window=(5, 1))
    data = make_case(case, "float32", 16, True, 3, variants)
    q, k, v = (torch.from_numpy(getattr(data, n)) for n in "qkv")
    arrays = {n: torch.from_numpy(variants[n]) for n in ("alibi_slopes", "sinks")}
    options = {**variants, **arrays}

    def eager(q, k, v):
        return kt.attention(q, k, v, causal=True, return_lse=True, **options)

    for run in (torch.compile(eager, fullgraph=True), eager):
        out, lse = run(q, k, v)
        assert_matches(out.numpy(), lse.numpy(), data, "float32")


def _grad_inputs(seed):
    """GQA q, k, v (fp32, requiring grad), per-head sinks, an additive mask and dout."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn((1, 4, 12, 16), generator=g).requires_grad_()
    k, v = (torch.randn((1, 2, 20, 16), generator=g).requires_grad_() for _ in range(2))
    sinks = torch.randn(4, generator=g).requires_grad_()
    mask = torch.randn((1, 1, 12, 20), generator=g)
    mask[..., 5] = float("-inf")
    return q, k, v, sinks, mask, torch.randn((1, 4, 12, 16), generator=g)


def test_the_backward_operator_passes_torch_library_checks():
    """The backward operator's schema and fake implementation (dq, dk, dv, dsinks), and the
    forward's autograd registration (torch.library.opcheck)."""
    q, k, v, sinks, mask, dout = _grad_inputs(4)
    out, lse = torch.ops.kernelgen.attention(q, k, v, mask, True, None, "bhsd", None, None,
                                             None, None, None, sinks)  # fmt: skip
    out = out.detach()
    for with_sinks in (sinks.detach(), None):
        args = (dout, q.detach(), k.detach(), v.detach(), out, lse, mask, True, None, "bhsd",
                None, None, None, with_sinks, False)  # fmt: skip
        torch.library.opcheck(
            torch.ops.kernelgen.attention_backward.default,
            args,
            test_utils=("test_schema", "test_faketensor"),
        )
    forward_args = (q, k, v, mask, True, None, "bhsd", None, None, None, None, None, sinks)
    torch.library.opcheck(
        torch.ops.kernelgen.attention.default,
        forward_args,
        test_utils=("test_schema", "test_autograd_registration", "test_faketensor"),
    )


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_torch_compile_fullgraph_traces_the_backward(layout):
    """A compiled training step (forward and backward traced, fullgraph) gives eager
    kernelgen.attention's gradients and float64's, sinks included; the mask gets none."""
    from kernelgen.references import attention as reference
    from kernelgen.references.attention import OUT_TOLERANCE, relative_error

    q, k, v, sinks, mask, dout = _grad_inputs(5)
    if layout == "bshd":
        q, k, v, dout = (x.detach().transpose(1, 2).requires_grad_() for x in (q, k, v, dout))
    mask.requires_grad_()
    options = {"causal": True, "layout": layout}

    def loss(q, k, v, sinks, mask):
        out = kt.attention(q * 1.0, k, v, mask=mask, sinks=sinks, **options)
        return (out * dout).sum()

    compiled = torch.compile(loss, fullgraph=True, backend="aot_eager")
    leaves = (q, k, v, sinks)
    got = torch.autograd.grad(compiled(q, k, v, sinks, mask), leaves)
    out = kernelgen.attention(q, k, v, mask=mask, sinks=sinks, **options)
    eager = torch.autograd.grad((out * dout).sum(), leaves)
    assert mask.grad is None
    order = (0, 1, 2, 3) if layout == "bhsd" else (0, 2, 1, 3)
    want = reference.attention_backward(
        *(x.detach().double().numpy().transpose(order) for x in (dout, q, k, v)),
        causal=True,
        mask=mask.detach().double().numpy(),
        sinks=sinks.detach().double().numpy(),
    )
    for name, g, e in zip(("dq", "dk", "dv", "dsinks"), got, eager, strict=True):
        assert g.shape == e.shape and g.dtype == e.dtype
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-6)
        w = getattr(want, name)
        error = relative_error(g.double().numpy().transpose(order[: g.ndim]), w)
        assert error <= OUT_TOLERANCE["float32"], f"{name}: relative error {error:.3g}"


def test_the_operator_has_no_backward_with_seqlens_k():
    q, k, v, *_ = _grad_inputs(6)
    out = kt.attention(q, k, v, seqlens_k=torch.tensor([15], dtype=torch.int32))
    with pytest.raises(kernelgen.InputError, match="seqlens_k has no backward"):
        out.sum().backward()
