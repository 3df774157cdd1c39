"""GPU tier: the fp8 (e4m3) wgmma forward on a compute capability 9.0 device, against the
float64 reference of the quantized inputs with the error bound that tests/test_emulated_fp8.py
derives and asserts on the emulator (docs/hopper.md, "fp8"). The kernel is launched through
its RuntimeKernel with the arguments the emulated run passes: e4m3 bit patterns, V as the V^T
operand (kernelgen.fp8.v_operand), fp32 descales per (batch, kv head), bf16 out."""

from __future__ import annotations

import numpy as np
import pytest
from test_emulated_fp8 import FP8_SPEC_PATHS, SHAPES, bound_ratio, problem, reference
from test_gpu_attention import require_compute_capability_9_0

from kernelgen.fp8 import v_operand
from kernelgen.launch import Problem, runtime_kernel
from kernelgen.spec import load_spec

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "b{}_h{}_hkv{}_sq{}_sk{}".format(*s))
@pytest.mark.parametrize("path", FP8_SPEC_PATHS, ids=lambda p: p.stem)
def test_fp8_wgmma_spec_on_gpu(path, shape):
    require_compute_capability_9_0()
    import cupy

    spec = load_spec(path)
    batch, heads, kv_heads, seqlen_q, seqlen_k = shape
    q, k, v, descales = problem(len(path.stem) + seqlen_k, *shape)
    scale = 128**-0.5
    v_t = v_operand(v)
    tensors = {
        "q": cupy.asarray(q),
        "k": cupy.asarray(k),
        "v": cupy.asarray(v_t),
        **{name: cupy.asarray(x) for name, x in descales.items()},
        "out": cupy.full((batch, heads, seqlen_q, 128), 0xFFFF, dtype=cupy.uint16),  # NaN
        "lse": cupy.full((batch, heads, seqlen_q), np.nan, dtype=cupy.float32),
    }
    run = Problem(
        batch=batch,
        num_heads=heads,
        num_kv_heads=kv_heads,
        seqlen_q=seqlen_q,
        seqlen_k=seqlen_k,
        head_dim=128,
        # 1-byte elements: NumPy's byte strides are element strides (v: the V^T copy's)
        q_strides=q.strides[:3],  # type: ignore[arg-type]
        k_strides=k.strides[:3],  # type: ignore[arg-type]
        v_strides=v_t.strides[:3],  # type: ignore[arg-type]
        out_strides=(heads * seqlen_q * 128, seqlen_q * 128, 128),
    )
    runtime_kernel(spec)(tensors, run, scale)
    bits = tensors["out"].get().astype(np.uint32) << 16
    out = bits.view(np.float32).astype(np.float64)
    ref, lse_ref, a, b = reference(q, k, v, descales, spec.causal, scale)
    assert np.isfinite(out).all()
    assert bound_ratio(out, ref, a, b) <= 1.0
    np.testing.assert_allclose(tensors["lse"].get(), lse_ref, rtol=0, atol=1e-4)
