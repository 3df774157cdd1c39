"""Emulation tier: ``torch.ops.kernelgen.attention`` (kernelgen.torch_ops), a torch custom
operator with a fake implementation, traced by ``torch.compile(fullgraph=True)`` and run on CPU
tensors through the CPU backend, against float64."""

from __future__ import annotations

import numpy as np
import pytest
from attention_cases import Case, assert_matches, example_variants, make_case

torch = pytest.importorskip("torch")
kt = pytest.importorskip("kernelgen.torch_ops")

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
