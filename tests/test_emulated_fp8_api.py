"""fp8 (e4m3) through ``kernelgen.attention`` on the CPU backend (the emulator): CPU torch
float8_e4m3fn tensors and NumPy ml_dtypes.float8_e4m3fn arrays, against the float64 reference
of the quantized inputs with the element-wise bound of tests/test_emulated_fp8.py (docs/hopper.md,
fp8); and every typed error of an fp8 call."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import CPU_BACKEND_MARKS
from test_emulated_fp8 import SHAPES, bound_ratio, problem, reference

import kernelgen
from kernelgen.references.fp8 import FP8_LSE_TOLERANCE, P_RELATIVE
from kernelgen.runtime import fp8 as fp8

torch = pytest.importorskip("torch")
ml_dtypes = pytest.importorskip("ml_dtypes")
if not hasattr(torch, "float8_e4m3fn"):
    pytest.skip("this torch has no float8_e4m3fn", allow_module_level=True)

pytestmark = CPU_BACKEND_MARKS

SCALE = 128**-0.5


def as_fp8(bits: np.ndarray, library: str, layout: str):
    """e4m3 bit patterns (B, H, S, D) as ``library``'s fp8 array; "bshd": a (B, S, H, D) view
    of the (B, H, S, D) memory (strides that are not the contiguous ones)."""
    if library == "torch":
        x = torch.from_numpy(bits).view(torch.float8_e4m3fn)
        return x.transpose(1, 2) if layout == "bshd" else x
    x = bits.view(ml_dtypes.float8_e4m3fn)
    return x.transpose(0, 2, 1, 3) if layout == "bshd" else x


def as_float64(out, library: str, layout: str) -> np.ndarray:
    """out (bfloat16, the call's layout) as float64 in (B, H, S, D) order."""
    host = out.float().numpy() if library == "torch" else out.astype(np.float32)
    host = host.astype(np.float64)
    return host.transpose(0, 2, 1, 3) if layout == "bshd" else host


# (library, layout, descales, causal, shape): both libraries, layouts, with and without
# descales, causal and not, GQA and MQA, lengths off the tiles and off 16.
CASES = [
    ("numpy", "bhsd", True, False, SHAPES[0]),
    ("torch", "bshd", True, True, SHAPES[1]),
    ("torch", "bhsd", False, True, SHAPES[0]),
    ("numpy", "bshd", False, False, SHAPES[1]),
]


@pytest.mark.parametrize(
    ("library", "layout", "with_descales", "causal", "shape"),
    CASES,
    ids=lambda x: str(x) if not isinstance(x, tuple) else "b{}_h{}_hkv{}_sq{}_sk{}".format(*x),
)
def test_fp8_attention_within_the_stated_bound(library, layout, with_descales, causal, shape):
    q, k, v, descales = problem(11 + shape[4], *shape, descales=with_descales)
    if library == "torch":
        scales = {name: torch.from_numpy(x) for name, x in descales.items()}
    else:
        scales = dict(descales)
    out, lse = kernelgen.attention(
        *(as_fp8(x, library, layout) for x in (q, k, v)),
        causal=causal,
        layout=layout,
        return_lse=True,
        **scales,
    )
    batch, heads, seqlen_q, dim = q.shape
    want_shape = (
        (batch, heads, seqlen_q, dim) if layout == "bhsd" else (batch, seqlen_q, heads, dim)
    )
    if library == "torch":
        assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
        lse = lse.numpy()
    else:
        assert out.dtype == ml_dtypes.bfloat16 and lse.dtype == np.float32
    assert tuple(out.shape) == want_shape and lse.shape == (batch, heads, seqlen_q)
    got = as_float64(out, library, layout)
    ref, lse_ref, a, b = reference(q, k, v, descales, causal, SCALE)
    ratio = bound_ratio(got, ref, a, b)
    relative = np.linalg.norm(got - ref) / np.linalg.norm(ref)
    print(f"{library} {layout}: max error / bound {ratio:.3f}, relative error {relative:.4f}")
    assert np.isfinite(got).all()
    assert ratio <= 1.0
    assert relative < P_RELATIVE
    np.testing.assert_allclose(lse, lse_ref, rtol=0, atol=FP8_LSE_TOLERANCE)


# Mutations of the host side the bound must catch: V^T's keys in the caller's order (the slots
# no longer match P's register order), v's descale not passed to the kernel.
API_MUTATIONS = {
    "V^T keys unpermuted": ("slot_of_key", lambda keys: np.arange(keys)),
    "v_descale dropped": ("check_descales", None),
}


@pytest.mark.parametrize("mutation", list(API_MUTATIONS))
def test_fp8_attention_mutations_break_the_bound(mutation, monkeypatch):
    name, replacement = API_MUTATIONS[mutation]
    if name == "check_descales":
        checked = fp8.check_descales

        def replacement(*args, **kwargs):
            return {n: x for n, x in checked(*args, **kwargs).items() if n != "v_descale"}

        monkeypatch.setattr("kernelgen.calls.fp8.check_descales", replacement)
    else:
        monkeypatch.setattr(fp8, name, replacement)
    q, k, v, descales = problem(3, 1, 2, 1, 64, 140)
    out = kernelgen.attention(*(as_fp8(x, "numpy", "bhsd") for x in (q, k, v)), **descales)
    ref, _, a, b = reference(q, k, v, descales, False, SCALE)
    ratio = bound_ratio(as_float64(out, "numpy", "bhsd"), ref, a, b)
    print(f"{mutation}: max error / bound {ratio:.2f}")
    assert ratio > 1.0
