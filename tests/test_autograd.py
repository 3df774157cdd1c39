"""Emulation tier: ``kernelgen.attention`` differentiated by torch autograd
(kernelgen.calls.training, kernelgen.calls.autograd) on CPU tensors, its gradients against the
float64 backward reference (kernelgen.references.attention.attention_backward) on the same values;
attention_varlen through it."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import kernelgen  # noqa: E402
from kernelgen.errors import InputTypeError  # noqa: E402
from kernelgen.references import attention as reference  # noqa: E402
from kernelgen.references.attention import OUT_TOLERANCE, relative_error  # noqa: E402

pytestmark = [
    pytest.mark.emulate,
    pytest.mark.filterwarnings("ignore::kernelgen.errors.CPUBackendWarning"),
]
TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def tensors(shape_q, shape_kv, dtype="float32", seed=0):
    """q, k, v and dout as leaf tensors of ``dtype`` that require grad (dout does not)."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(s, generator=g) for s in (shape_q, shape_kv, shape_kv))
    dout = torch.randn(shape_q, generator=g)
    q, k, v, dout = (x.to(TORCH_DTYPES[dtype]) for x in (q, k, v, dout))
    return q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), dout


def host(x):
    """A tensor (or None) as float64 NumPy, in the values it holds."""
    return None if x is None else x.detach().double().numpy()


def expected(dout, q, k, v, layout="bhsd", **options):
    """The float64 reference gradients, in the inputs' layout."""
    order = (0, 1, 2, 3) if layout == "bhsd" else (0, 2, 1, 3)
    grads = reference.attention_backward(
        *(host(x).transpose(order) for x in (dout, q, k, v)),
        **{n: host(x) if isinstance(x, torch.Tensor) else x for n, x in options.items()},
    )
    return grads, [x.transpose(order) for x in (grads.dq, grads.dk, grads.dv)]


def assert_grads(got, want, dtype="float32"):
    assert len(got) == len(want)
    for name, g, w in zip(("dq", "dk", "dv", "dsinks"), got, want, strict=False):
        assert g is not None, name
        error = relative_error(host(g), w)
        assert error <= OUT_TOLERANCE[dtype], f"{name}: relative error {error:.3g}"


def slopes_and_sinks(heads):
    g = torch.Generator().manual_seed(7)
    return torch.rand(heads, generator=g) * 0.5, torch.randn(heads, generator=g)


# name -> (B, H, Hkv, Sq, Sk, D, options)
CASES = {
    "plain": (1, 2, 2, 24, 24, 16, {}),
    "causal": (1, 2, 2, 20, 32, 16, {"causal": True}),
    "gqa-causal": (2, 4, 2, 17, 17, 32, {"causal": True}),
    "window": (1, 2, 1, 24, 30, 16, {"window_size": (5, 2)}),
    "softcap": (1, 2, 2, 24, 24, 16, {"softcap": 1.5, "scale": 0.7}),
    "alibi": (1, 2, 2, 16, 24, 16, {"alibi_slopes": "slopes", "causal": True}),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_gradients_match_the_float64_reference(name):
    b, h, hkv, sq, sk, d, options = CASES[name]
    if options.get("alibi_slopes") == "slopes":
        options = {**options, "alibi_slopes": slopes_and_sinks(h)[0]}
    q, k, v, dout = tensors((b, h, sq, d), (b, hkv, sk, d), seed=len(name))
    out = kernelgen.attention(q, k, v, **options)
    assert out.requires_grad and out.grad_fn is not None
    out.backward(dout)
    grads, want = expected(dout, q, k, v, **options)
    assert relative_error(host(out), grads.out) <= OUT_TOLERANCE["float32"]
    assert_grads((q.grad, k.grad, v.grad), want)


def test_sinks_get_their_gradient():
    h = 4
    q, k, v, dout = tensors((1, h, 20, 16), (1, 2, 28, 16), seed=3)
    sinks = slopes_and_sinks(h)[1].requires_grad_()
    kernelgen.attention(q, k, v, causal=True, sinks=sinks).backward(dout)
    grads, want = expected(dout, q, k, v, causal=True, sinks=sinks)
    assert sinks.grad.dtype == torch.float32 and sinks.grad.shape == (h,)
    assert_grads((q.grad, k.grad, v.grad, sinks.grad), (*want, grads.dsinks))


def test_an_additive_mask_gets_no_gradient():
    """The mask is a constant of the backward (fully hidden rows included: zero gradients)."""
    q, k, v, dout = tensors((2, 2, 16, 16), (2, 2, 24, 16), seed=4)
    g = torch.Generator().manual_seed(5)
    mask = torch.randn((2, 1, 16, 24), generator=g)
    mask[torch.rand((2, 1, 16, 24), generator=g) < 0.3] = float("-inf")
    mask[0, :, 3] = float("-inf")  # a row that sees no key
    mask.requires_grad_()
    kernelgen.attention(q, k, v, mask=mask).backward(dout)
    assert mask.grad is None
    _, want = expected(dout, q, k, v, mask=mask)
    assert_grads((q.grad, k.grad, v.grad), want)
    assert (q.grad[0, :, 3] == 0).all()


def test_bshd_layout_and_strided_views():
    """q, k, v as (B, S, H, D) views of one packed qkv projection (strided, not contiguous)."""
    g = torch.Generator().manual_seed(6)
    qkv = torch.randn((1, 20, 3, 2, 16), generator=g).requires_grad_()
    q, k, v = qkv.unbind(2)
    assert not q.is_contiguous()
    dout = torch.randn((1, 20, 2, 16), generator=g)
    kernelgen.attention(q, k, v, causal=True, layout="bshd").backward(dout)
    _, want = expected(dout, q, k, v, layout="bshd", causal=True)
    assert_grads(qkv.grad.unbind(2), want)


def test_a_transposed_view_of_q():
    g = torch.Generator().manual_seed(8)
    base = torch.randn((1, 24, 2, 16), generator=g).requires_grad_()
    q = base.transpose(1, 2)  # (B, H, S, D) with head stride 16, sequence stride 32
    _, k, v, dout = tensors((1, 2, 24, 16), (1, 2, 24, 16), seed=9)
    kernelgen.attention(q, k, v).backward(dout)
    _, want = expected(dout, q, k, v)
    assert_grads((base.grad.transpose(1, 2), k.grad, v.grad), want)


def test_out_sum_backward():
    """The README's example: the loss's gradient reaches the kernel expanded (stride 0)."""
    q, k, v, _ = tensors((1, 2, 16, 16), (1, 2, 16, 16), seed=10)
    out = kernelgen.attention(q, k, v, causal=True)
    out.sum().backward()
    _, want = expected(torch.ones_like(out), q, k, v, causal=True)
    assert_grads((q.grad, k.grad, v.grad), want)


def test_only_the_inputs_that_require_grad_get_one():
    q, k, v, dout = tensors((1, 2, 16, 16), (1, 2, 16, 16), seed=11)
    q, v = q.detach(), v.detach()
    kernelgen.attention(q, k, v).backward(dout)
    assert q.grad is None and v.grad is None and k.grad is not None


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_gradients(dtype):
    q, k, v, dout = tensors((1, 4, 24, 32), (1, 2, 24, 32), dtype, seed=12)
    kernelgen.attention(q, k, v, causal=True).backward(dout)
    assert q.grad.dtype == k.grad.dtype == TORCH_DTYPES[dtype]
    _, want = expected(dout, q, k, v, causal=True)
    assert_grads((q.grad, k.grad, v.grad), want, dtype)


def test_deterministic_backward_is_bitwise_reproducible(monkeypatch):
    """deterministic=True reaches the backward (so does torch's deterministic mode)."""
    import kernelgen.calls.autograd

    seen = []

    def spy(*args, deterministic, **kwargs):
        seen.append(deterministic)
        return backward(*args, deterministic=deterministic, **kwargs)

    backward = kernelgen.calls.autograd.attention_backward
    monkeypatch.setattr(kernelgen.calls.autograd, "attention_backward", spy)
    runs = []
    for _ in range(2):
        q, k, v, dout = tensors((1, 2, 40, 16), (1, 1, 40, 16), seed=13)
        kernelgen.attention(q, k, v, causal=True, deterministic=True).backward(dout)
        runs.append((q.grad, k.grad, v.grad))
    for first, second in zip(*runs, strict=True):
        assert torch.equal(first, second)
    _, want = expected(dout, q, k, v, causal=True)
    assert_grads(runs[1], want)
    kernelgen.attention(q, k, v).sum().backward()
    monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda: True)
    kernelgen.attention(q, k, v).sum().backward()
    assert seen == [True, True, False, True]
    with pytest.raises(InputTypeError, match="deterministic"):
        kernelgen.attention(q, k, v, deterministic="yes")


def test_block_mask_calls_differentiate_through_their_mask_mod():
    """A block-sparse forward (fp16: block masks need tensor cores); the backward evaluates the
    mask_mod on every key tile (a document mask)."""
    q, k, v, dout = tensors((1, 2, 40, 16), (1, 2, 40, 16), "float16", seed=14)
    doc = torch.tensor([[0] * 12 + [1] * 18 + [2] * 10], dtype=torch.int32)
    text = "doc[b, q_idx] == doc[b, kv_idx]"
    inputs = {"doc": doc}
    blocks = kernelgen.block_mask(text, 1, 1, 40, 40, block_m=16, block_n=16, mod_inputs=inputs)
    kernelgen.attention(q, k, v, causal=True, mod_inputs=inputs, block_mask=blocks).backward(dout)
    ids = doc[0].numpy()
    mask = np.where(ids[:, None] == ids[None, :], 0.0, -np.inf)
    _, want = expected(dout, q, k, v, causal=True, mask=mask)
    assert_grads((q.grad, k.grad, v.grad), want, "float16")


def test_the_lse_carries_no_gradient():
    q, k, v, _ = tensors((1, 2, 16, 16), (1, 2, 16, 16), seed=15)
    out, lse = kernelgen.attention(q, k, v, return_lse=True)
    assert out.requires_grad and not lse.requires_grad and lse.dtype == torch.float32
    ref_lse = reference.naive_attention(*(host(x) for x in (q, k, v)))[1]
    assert np.max(np.abs(lse.numpy() - ref_lse)) <= reference.LSE_TOLERANCE


def test_no_double_backward():
    q, k, v, _ = tensors((1, 2, 16, 16), (1, 2, 16, 16), seed=16)
    out = kernelgen.attention(q, k, v)
    (dq,) = torch.autograd.grad((out**2).sum(), q, create_graph=True)
    with pytest.raises(RuntimeError, match="differentiate twice"):
        dq.sum().backward()


def test_inference_calls_stay_off_the_graph():
    q, k, v, _ = tensors((1, 2, 16, 16), (1, 2, 16, 16), seed=17)
    with torch.no_grad():
        assert kernelgen.attention(q, k, v).grad_fn is None
    with torch.inference_mode():
        assert not kernelgen.attention(q, k, v).requires_grad
    plain = kernelgen.attention(q.detach(), k.detach(), v.detach())
    assert plain.grad_fn is None
    arrays = kernelgen.attention(*(host(x).astype(np.float32) for x in (q, k, v)))
    assert isinstance(arrays, np.ndarray)
    np.testing.assert_array_equal(arrays, plain.numpy())


def test_attention_varlen_differentiates():
    """Three packed sequences of different lengths (one call each), causal, GQA: the packed
    gradients are each sequence's own."""
    lengths_q, lengths_k = [5, 12, 7], [9, 12, 15]
    heads, kv_heads, d = 2, 1, 16
    q, k, v, dout = tensors((sum(lengths_q), heads, d), (sum(lengths_k), kv_heads, d), seed=18)
    cu_q, cu_k = ([0, *np.cumsum(n).tolist()] for n in (lengths_q, lengths_k))
    out = kernelgen.attention_varlen(q, k, v, cu_q, cu_k, 12, 15, causal=True)
    out.backward(dout)
    for b in range(3):
        rows, keys = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        # one sequence as (1, S, H, D), bshd
        one = [x[None] for x in (dout[rows], q[rows], k[keys], v[keys])]
        _, want = expected(*one, layout="bshd", causal=True)
        got = (q.grad[rows], k.grad[keys], v.grad[keys])
        assert_grads([g[None] for g in got], want)
