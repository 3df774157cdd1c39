"""The fp8 (e4m3) wgmma forward with the built-in variants (window, softcap, ALiBi, sinks), user
expressions (score_mod, mask_mod) and ``seqlens_k`` (docs/hopper.md, "fp8"), on the emulator
against the float64 reference of the quantized inputs (kernelgen.references.fp8) within the
element-wise bound of tests/test_emulated_fp8.py, the relative Frobenius error below 2^-4 and
the lse within 1e-4.

What the variants see: the q and k descales are folded into the scores' scale, so softcap caps
the descaled, scaled score (and score_mod receives it), while ALiBi and the window are positional
and a sink is a per-head logit: no descale touches them. A sink is a key of value 0, so it joins
l only and v's descale (applied to O) never meets it; in fp8 its state starts REFERENCE_OFFSET
below the sink, so a row whose scores lie below a large sink keeps its weights normal e4m3
numbers. With ``seqlens_k`` the V^T copy zeroes each entry's keys past its length: a cache's
rows there may hold NaN.

Cases: the shipped spec (causal + window + softcap + sinks, GQA, d128); head dim 96 with the
overlap and Q in registers (ALiBi per batch entry, a two-sided window, softcap; MQA); NaN rows
past seqlens_k through kernelgen.attention on NumPy arrays (causal + window) and through the
torch custom op on CPU tensors (bshd, ALiBi, sinks); a score_mod reading a bf16 bias table with a
document mask_mod through kernelgen.attention. Mutations the checks catch follow.
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import CPU_BACKEND_MARKS, ROOT
from test_emulated_expressions import _callables
from test_emulated_fp8 import fp8_spec, problem

import kernelgen
from kernelgen.calls.emulated import emulate_fp8_attention
from kernelgen.kernels.render import render
from kernelgen.references.fp8 import FP8_LSE_TOLERANCE, FP8_TOLERANCE, Fp8Reference, fp8_reference
from kernelgen.runtime import fp8 as fp8_runtime
from kernelgen.specs.forward import load_spec

ml_dtypes = pytest.importorskip("ml_dtypes")

pytestmark = CPU_BACKEND_MARKS

SPEC = load_spec(ROOT / "specs" / "v2_wg_e4m3_d128_m128_n128_s2_causal_window_softcap_sinks.yaml")
NAN = 0x7F  # an e4m3 NaN bit pattern (S.1111.111)


def combo_variants(heads: int) -> dict:
    """A narrow window (one key more or less is visible in the checks), a cap of 2 (scores of
    about 1-3 are capped hard) and sinks above most scores (weights below the sink, which the
    sink's reference must keep normal e4m3 numbers)."""
    sinks = np.linspace(3.0, 5.0, heads).astype(np.float32)
    return {"window_size": (9, 0), "softcap": 2.0, "sinks": sinks}


def measure(out, lse, ref: Fp8Reference) -> tuple[float, float, float]:
    """(max error / bound, relative Frobenius error, max lse error) against ``ref``."""
    out = np.asarray(out, np.float64)
    ratio = ref.bound_ratio(out)
    relative = float(np.linalg.norm(out - ref.out) / np.linalg.norm(ref.out))
    lse_error = float(np.max(np.abs(np.asarray(lse, np.float64) - ref.lse)))
    print(f"max error / bound {ratio:.3f}, relative error {relative:.4f}, lse {lse_error:.2e}")
    return ratio, relative, lse_error


def assert_within_bound(out, lse, ref: Fp8Reference) -> None:
    assert np.isfinite(np.asarray(out, np.float64)).all()
    ratio, relative, lse_error = measure(out, lse, ref)
    assert ratio <= 1.0
    assert relative < FP8_TOLERANCE
    assert lse_error <= FP8_LSE_TOLERANCE


def combo_case(seed: int, shape: tuple[int, ...], source: str | None = None):
    """The shipped spec on ``shape`` with :func:`combo_variants`: (result, reference)."""
    q, k, v, descales = problem(seed, *shape)
    variants = combo_variants(shape[1])
    result = emulate_fp8_attention(SPEC, q, k, v, source=source, **descales, **variants)
    ref = fp8_reference(q, k, v, descales, causal=True, scale=128**-0.5, **variants)
    return result, ref


def test_causal_window_softcap_sinks_spec_with_gqa_within_the_bound():
    result, ref = combo_case(5, (2, 4, 2, 70, 150))
    assert_within_bound(result.out, result.lse, ref)


def test_d96_overlap_q_in_registers_with_alibi_window_and_softcap_within_the_bound():
    """Head dim 96 (its V^T tile smaller than a K tile), the overlapped loop with Q in
    registers; ALiBi slopes per batch entry (B, H), a window bounded on both sides, a cap."""
    spec = fp8_spec(head_dim=96, overlap=True, q_in_registers=True, stages=3, window=True,
                    softcap=True, alibi=True)  # fmt: skip
    q, k, v, descales = problem(6, 2, 2, 1, 70, 150, head_dim=96)
    slopes = np.array([[0.05, 0.3], [0.1, 0.02]], np.float32)
    variants = {"window_size": (30, 12), "softcap": 4.0, "alibi_slopes": slopes}
    result = emulate_fp8_attention(spec, q, k, v, **descales, **variants)
    ref = fp8_reference(q, k, v, descales, causal=False, scale=96**-0.5, **variants)
    assert_within_bound(result.out, result.lse, ref)


def cache_problem(seed: int, lengths: list[int], heads: int = 4, kv_heads: int = 2):
    """An fp8 problem whose K/V rows past each entry's length hold NaN: (q, k, v, descales)."""
    q, k, v, descales = problem(seed, len(lengths), heads, kv_heads, 70, 160)
    for b, length in enumerate(lengths):
        k[b, :, length:] = NAN
        v[b, :, length:] = NAN
    return q, k, v, descales


def test_seqlens_k_with_nan_rows_past_it_through_kernelgen_attention():
    """NumPy ml_dtypes arrays, causal + window (each aligned to its entry's length), host
    lengths off the tiles and off 16; rows past them hold NaN in k and v."""
    lengths = [97, 133]
    q, k, v, descales = cache_problem(7, lengths)
    spec = fp8_spec(causal=True, window=True)
    out, lse = kernelgen.attention(
        *(x.view(ml_dtypes.float8_e4m3fn) for x in (q, k, v)), causal=True, spec=spec,
        return_lse=True, seqlens_k=lengths, window_size=(40, 0), **descales,
    )  # fmt: skip
    ref = fp8_reference(q, k, v, descales, causal=True, scale=128**-0.5, seqlens_k=lengths,
                        window_size=(40, 0))  # fmt: skip
    assert_within_bound(out.astype(np.float32), lse, ref)


def test_seqlens_k_with_nan_rows_through_the_torch_op_with_alibi_and_sinks():
    """The custom op on CPU torch tensors (the default spec: the call's variants), bshd layout,
    seqlens_k as an int32 tensor, ALiBi (H,) and sinks; NaN rows past the lengths."""
    torch = pytest.importorskip("torch")
    if not hasattr(torch, "float8_e4m3fn"):
        pytest.skip("this torch has no float8_e4m3fn")
    import kernelgen.torch_ops  # noqa: F401 (registers torch.ops.kernelgen)

    lengths = [150, 61]
    q, k, v, descales = cache_problem(8, lengths)
    slopes = np.array([0.2, 0.05, 0.1, 0.4], np.float32)
    sinks = np.array([1.0, 3.0, -2.0, 0.5], np.float32)

    def bshd(bits):
        return torch.from_numpy(np.ascontiguousarray(bits.transpose(0, 2, 1, 3))).view(
            torch.float8_e4m3fn
        )

    seqlens_k = torch.tensor(lengths, dtype=torch.int32)
    out, lse = torch.ops.kernelgen.attention(
        bshd(q), bshd(k), bshd(v), layout="bshd", seqlens_k=seqlens_k,
        alibi_slopes=torch.from_numpy(slopes), sinks=torch.from_numpy(sinks),
        **{name: torch.from_numpy(x) for name, x in descales.items()},
    )  # fmt: skip
    assert out.dtype == torch.bfloat16 and out.shape == (2, 70, 4, 128)
    ref = fp8_reference(q, k, v, descales, causal=False, scale=128**-0.5, seqlens_k=lengths,
                        alibi_slopes=slopes, sinks=sinks)  # fmt: skip
    assert_within_bound(out.float().numpy().transpose(0, 2, 1, 3), lse.numpy(), ref)


# User expressions (docs/expressions.md): a relative bias from a bf16 table and a distance term
# (score_mod receives the descaled, scaled score, as the reference's hook does) and a document
# mask from per-key document ids, queries aligned bottom right.
SCORE_MOD = "score + 0.5 * bias[h, q_idx, kv_idx] - 0.01 * abs(q_idx - kv_idx)"
MASK_MOD = "doc[b, q_idx + offset[0]] == doc[b, kv_idx]"
EXPRESSION_SHAPE = (2, 4, 2, 70, 150)


def expression_case(seed: int) -> tuple:
    """(q, k, v, descales, the expressions' keywords, the reference's hooks)."""
    batch, heads, _, seqlen_q, seqlen_k = EXPRESSION_SHAPE
    q, k, v, descales = problem(seed, *EXPRESSION_SHAPE)
    rng = np.random.default_rng(seed + 1)
    bias = rng.standard_normal((heads, seqlen_q, seqlen_k)).astype(np.float32)
    inputs = {
        "bias": bias.astype(ml_dtypes.bfloat16),
        "doc": np.sort(rng.integers(0, 3, (batch, seqlen_k)), axis=1).astype(np.int32),
        "offset": np.array([seqlen_k - seqlen_q], np.int64),
    }
    keywords = {"score_mod": SCORE_MOD, "mask_mod": MASK_MOD, "mod_inputs": inputs}
    return q, k, v, descales, keywords, _callables(SCORE_MOD, MASK_MOD, inputs)


def test_user_expressions_through_kernelgen_attention_within_the_bound():
    """score_mod and mask_mod with their mod inputs on NumPy arrays, causal GQA: the default
    fp8 spec compiled with the call's expressions (the call names none)."""
    q, k, v, descales, keywords, hooks = expression_case(12)
    out, lse = kernelgen.attention(
        *(x.view(ml_dtypes.float8_e4m3fn) for x in (q, k, v)), causal=True, return_lse=True,
        **keywords, **descales,
    )  # fmt: skip
    ref = fp8_reference(q, k, v, descales, causal=True, scale=128**-0.5, **hooks)
    assert_within_bound(out.astype(np.float32), lse, ref)


def test_score_mod_given_a_differently_scaled_score_is_caught():
    """Mutation: score_mod evaluated on half the score and its result doubled (a descale
    product of 2 applied after the expression instead of before it)."""
    q, k, v, descales, keywords, hooks = expression_case(12)
    spec = fp8_spec(causal=True, score_mod=SCORE_MOD, mask_mod=MASK_MOD,
                    mod_inputs=["bias:bfloat16[3]", "doc:int32[2]", "offset:int64[1]"])  # fmt: skip
    old = "x = kg_score_mod(x * LN2,"
    source = render(spec)
    assert source.count(old) == 1
    source = source.replace(old, "x = 2.f * kg_score_mod(x * LN2 / 2.f,")
    result = emulate_fp8_attention(spec, q, k, v, source=source, **descales, **keywords)
    ref = fp8_reference(q, k, v, descales, causal=True, scale=128**-0.5, **hooks)
    ratio, relative, lse_error = measure(result.out, result.lse, ref)
    assert ratio > 1.0 or relative >= FP8_TOLERANCE or lse_error > FP8_LSE_TOLERANCE


# ---- mutations -------------------------------------------------------------------------------
# Each replaces one line of the shipped spec's source; the combo case's checks (bound, relative
# error, lse) must fail. The sink's state at the sink itself (the 16-bit one): its weights lose
# e4m3's precision below the sink; the sink weighted by v's descale (as if it were a value);
# the cap taken before the q/k descales (c tanh(s / c) of the undescaled score, then descaled:
# a cap of c qd kd). The window's left bound one key wider ("key >= diagonal - va.left - 1", the
# shared variant code the 16-bit tests cover) failed this case at 113x the bound when run once.
SINK_STATE = (
    "    m[0][half] = sink_log2(sinks, rows.head(row_g + 8 * half)) - REFERENCE_OFFSET;\n"
    "    l[0][half] = lane % 4 == 0 ? exp2f(REFERENCE_OFFSET) : 0.f;\n"
)
DESCALES = "  const float out_factor = v_descale ? v_descale[descale_index] : 1.f;\n"
MUTATIONS = {
    "sink state at the sink": (
        SINK_STATE,
        "    m[0][half] = sink_log2(sinks, rows.head(row_g + 8 * half));\n"
        "    l[0][half] = lane % 4 == 0 ? 1.f : 0.f;\n",
    ),
    "sink weighted by v_descale": (
        SINK_STATE,
        SINK_STATE.replace("exp2f(REFERENCE_OFFSET) :", "exp2f(REFERENCE_OFFSET) * out_factor :"),
    ),
    "cap before the descales": (
        DESCALES,
        DESCALES + "  const float qk_descale = score_scale_log2 / scale_log2;\n"
        "  const_cast<Variant&>(va).cap_log2 *= qk_descale;\n"
        "  const_cast<Variant&>(va).inv_cap_log2 /= qk_descale;\n",
    ),
}


@pytest.mark.parametrize("mutation", list(MUTATIONS))
def test_variant_mutations_are_caught(mutation):
    old, new = MUTATIONS[mutation]
    source = render(SPEC)
    assert source.count(old) == 1
    result, ref = combo_case(3, (1, 2, 1, 64, 140), source=source.replace(old, new))
    ratio, relative, lse_error = measure(result.out, result.lse, ref)
    assert ratio > 1.0 or relative >= FP8_TOLERANCE or lse_error > FP8_LSE_TOLERANCE


def test_v_operand_zeroes_the_keys_past_each_length():
    """V^T of bytes with seqlens_k: each entry's keys from its length on are 0 wherever their
    slot is, the others v's bytes; lengths past Sk keep every key, negative ones none. (Run once,
    not kept: kernelgen.calls.fp8 with a v_operand that ignores the lengths gives NaN in out on
    the NaN-row case above.)"""
    rng = np.random.default_rng(9)
    v = rng.integers(1, 256, (4, 2, 37, 64), dtype=np.uint8)
    lengths = np.array([0, 20, 37, 99], np.int32)
    got = fp8_runtime.v_operand(v, lengths)
    want = fp8_runtime.v_operand(v)
    for b, length in enumerate(np.clip(lengths, 0, 37)):
        slots = fp8_runtime.slot_of_key(48)
        np.testing.assert_array_equal(got[b][..., slots[:length]], want[b][..., slots[:length]])
        assert not got[b][..., slots[length:]].any()
    np.testing.assert_array_equal(fp8_runtime.v_operand(v, np.array([-3] * 4, np.int32)), 0)
