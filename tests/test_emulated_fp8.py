"""The fp8 (e4m3) wgmma forward on the emulator against a float64 reference of the quantized
inputs (docs/hopper.md, "fp8").

The reference decodes the e4m3 bit patterns exactly, applies the descales and computes softmax
attention in float64. The kernel's only rounding beyond fp32 is that of the weights P (and the
bf16 output): the weights 2^(s - m), m placed 8 below the running maximum (at most 256, the
maximum's weight), are rounded to e4m3, so a weight's relative error is at most 2^-4 while it is
>= 2^-6 (a normal e4m3 number), i.e. >= 2^-14 of the maximum's, and its absolute error at most
2^-10 = 2^-18 of the maximum's weight below. With l the exact row sum (fp32 weights) and
rescaling by factors <= 1, every output element obeys

    |out - ref| <= vd (2^-4 sum_j p_j |v_j| + 2^-18 sum_j |v_j|) / l + 2^-8 |ref| + fp32 slack,

p the float64 weights, vd the v descale; 2^-8 |ref| covers the bf16 output's rounding. The
tests assert it element by element, and the relative Frobenius error below 2^-4.
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import WGMMA_SPEC_PATHS

from kernelgen.calls.emulated import emulate_attention, emulate_fp8_attention
from kernelgen.errors import HazardError, InputError, InputTypeError, SpecError
from kernelgen.kernels.render import render
from kernelgen.references.fp8 import Fp8Reference, fp8_mismatches, fp8_reference, quantize
from kernelgen.runtime.fp8 import KEY_ORDER, check_descales, decode_e4m3, v_operand
from kernelgen.specs.forward import load_spec, spec_from_dict

pytestmark = pytest.mark.emulate

FP8_SPEC = {
    "loop_order": "v2",
    "dtype": "float8_e4m3",
    "head_dim": 128,
    "block_m": 128,
    "block_n": 128,
    "mma": "wgmma",
    "archs": ["sm_90a"],
}


def fp8_spec(**fields):
    return spec_from_dict({**FP8_SPEC, **fields})


def reference(q, k, v, descales, causal: bool, scale: float):
    """float64 attention of the decoded inputs (kernelgen.references.fp8, which decodes through
    ml_dtypes, not the kernels' table): (out, lse, A, B) with A = vd sum p |v| / l and
    B = vd sum |v| / l (the bound's terms)."""
    r = fp8_reference(q, k, v, descales, causal=causal, scale=scale)
    return r.out, r.lse, r.weighted, r.total


def bound_ratio(out, ref, a, b) -> float:
    """max |out - ref| / bound over the elements (<= 1: within the stated bound)."""
    return Fp8Reference(out=ref, lse=np.empty(0), weighted=a, total=b).bound_ratio(out)


def problem(seed, batch, heads, kv_heads, seqlen_q, seqlen_k, descales=True, head_dim=128):
    rng = np.random.default_rng(seed)
    q = quantize(rng.normal(0, 1.5, (batch, heads, seqlen_q, head_dim)))
    k = quantize(rng.normal(0, 1.5, (batch, kv_heads, seqlen_k, head_dim)))
    v = quantize(rng.normal(0, 2.0, (batch, kv_heads, seqlen_k, head_dim)))
    scales = {}
    if descales:
        scales = {
            name: rng.uniform(0.5, 2.0, (batch, kv_heads)).astype(np.float32)
            for name in ("q_descale", "k_descale", "v_descale")
        }
    return q, k, v, scales


# The shipped fp8 specs without variants or expressions (those with variants need their values:
# tests/test_emulated_fp8_variants.py runs them; the block-sparse document mask needs its
# documents and block mask: tests/test_emulated_fp8_block_sparse.py).
FP8_SPEC_PATHS = [
    p
    for p in WGMMA_SPEC_PATHS
    if load_spec(p).fp8
    and not load_spec(p).variants
    and not load_spec(p).has_expressions
    and not load_spec(p).split_kv  # the decode default: tests/test_emulated_fp8_decode.py
]
# (batch, heads, kv heads, Sq, Sk): GQA and MQA, lengths off the tiles (and Sk off 16)
SHAPES = [(2, 4, 2, 70, 150), (1, 3, 1, 131, 200)]


def test_fp8_spec_files_cover_the_loops():
    """The plain loop causal and not, Q in registers, the overlap with and without it."""
    loops = {(s.causal, s.overlap, s.q_in_registers) for s in map(load_spec, FP8_SPEC_PATHS)}
    assert loops == {(False, False, False), (True, False, False), (False, False, True),
                     (False, True, False), (False, True, True)}  # fmt: skip


def _spec_cases() -> list:
    """Every fp8 spec on the first shape; the plain-loop specs on both (the other loops take the
    second shape in tests/test_emulated_fp8_loops.py)."""
    cases = []
    for path in FP8_SPEC_PATHS:
        spec = load_spec(path)
        plain = not (spec.overlap or spec.q_in_registers or spec.pingpong)
        for shape in SHAPES if plain else SHAPES[:1]:
            label = "{}-b{}_h{}_hkv{}_sq{}_sk{}".format(path.stem, *shape)
            cases.append(pytest.param(path, shape, id=label))
    return cases


@pytest.mark.parametrize(("path", "shape"), _spec_cases())
def test_fp8_forward_within_the_stated_bound(path, shape):
    spec = load_spec(path)
    causal = spec.causal
    q, k, v, descales = problem(1, *shape, head_dim=spec.head_dim)
    result = emulate_fp8_attention(spec, q, k, v, **descales)
    ref = fp8_reference(q, k, v, descales, causal=causal, scale=spec.head_dim**-0.5)
    found = fp8_mismatches(result.out, result.lse, ref)  # the fuzzer's check too
    print(f"{spec.uri}: max error / bound {found.bound_ratio:.3f}, relative Frobenius error "
          f"{found.out_error:.4f}")  # fmt: skip
    assert not found.failed, found


def test_fp8_descales_default_to_one():
    spec = fp8_spec()
    q, k, v, _ = problem(2, 1, 2, 2, 40, 130, descales=False)
    result = emulate_fp8_attention(spec, q, k, v)
    ref, _, a, b = reference(q, k, v, {}, False, 128**-0.5)
    assert bound_ratio(result.out, ref, a, b) <= 1.0
    ones = {n: np.ones((1, 2), np.float32) for n in ("q_descale", "k_descale", "v_descale")}
    np.testing.assert_array_equal(emulate_fp8_attention(spec, q, k, v, **ones).out, result.out)


# Mutations of the kernel the bound must catch: a descale dropped, the weights' byte order
# within a register swapped (P no longer matches V^T's key order), the reference at the maximum
# (weights <= 1: small ones lose e4m3's precision), a reference 9 below (weights up to 512
# saturate at 448).
MUTATIONS = {
    "v_descale dropped": ("v_descale ? v_descale[descale_index] : 1.f", "1.f"),
    "k_descale dropped": ("(k_descale ? k_descale[descale_index] : 1.f)", "1.f"),
    "weights in the wrong key slots": ('"f"(x1), "f"(x0)', '"f"(x0), "f"(x1)'),
    "reference at the maximum": (
        "REFERENCE_OFFSET = RESCALE_SLACK;",
        "REFERENCE_OFFSET = 0.f;",
    ),
    "weights past e4m3's range": (
        "REFERENCE_OFFSET = RESCALE_SLACK;",
        "REFERENCE_OFFSET = RESCALE_SLACK + 1.f;",
    ),
}


@pytest.mark.parametrize("mutation", list(MUTATIONS))
def test_fp8_mutations_break_the_bound(mutation):
    spec = fp8_spec()
    old, new = MUTATIONS[mutation]
    source = render(spec)
    assert old in source
    q, k, v, descales = problem(3, 1, 2, 1, 64, 140)
    result = emulate_fp8_attention(spec, q, k, v, source=source.replace(old, new), **descales)
    ref, _, a, b = reference(q, k, v, descales, False, 128**-0.5)
    ratio = bound_ratio(result.out, ref, a, b)
    print(f"{mutation}: max error / bound {ratio:.2f}")
    assert ratio > 1.0


def test_v_operand_is_v_transposed_with_keys_permuted():
    rng = np.random.default_rng(4)
    v = rng.integers(0, 256, (2, 3, 37, 128), dtype=np.uint8)
    vt = v_operand(v)
    assert vt.shape == (2, 3, 128, 48) and vt.flags.c_contiguous
    assert sorted(KEY_ORDER) == list(range(16))
    for slot in range(48):
        key = 16 * (slot // 16) + KEY_ORDER[slot % 16]
        expected = v[:, :, key, :] if key < 37 else 0
        np.testing.assert_array_equal(vt[:, :, :, slot], expected)


def test_decode_e4m3_matches_ml_dtypes():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    bits = np.arange(256, dtype=np.uint8)
    expected = bits.view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    np.testing.assert_array_equal(decode_e4m3(bits), expected)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (
            {"mma": "mma_sync", "block_m": 64, "num_warps": 4},
            "dtype='float8_e4m3' is not allowed with mma='mma_sync'",
        ),
        (
            {"mma": "simt", "archs": ["sm_80"], "block_m": 64, "block_n": 64},
            "float8_e4m3 needs mma: wgmma",
        ),
        (
            {"block_n": 96},
            "block_n=96 is not allowed with dtype='float8_e4m3' and head_dim=128; use 128 or 64",
        ),
        (
            {"head_dim": 256},
            "block_n=128 is not allowed with dtype='float8_e4m3' and head_dim=256; use 64",
        ),
        (
            {"head_dim": 80},
            "head_dim=80 is not allowed with dtype='float8_e4m3'; use "
            "64 or 96 or 128 or 192 or 256",
        ),
        (
            {"head_dim": 64, "epilogue": "tma"},
            "epilogue='tma' is not allowed with dtype='float8_e4m3' and head_dim=64",
        ),
        ({"split_kv": True}, "split_kv=True is not allowed with dtype='float8_e4m3'"),
        ({"paged_kv": True}, "paged_kv=True is not allowed with dtype='float8_e4m3'"),
    ],
)
def test_fp8_spec_errors_name_field_value_and_allowed(fields, message):
    with pytest.raises(SpecError, match=message.replace("(", r"\(").replace(")", r"\)")):
        fp8_spec(**fields)


def test_fp8_spec_names_and_output_type():
    spec = fp8_spec(causal=True)
    assert spec.uri == "fa_fwd_v2_wg_e4m3_d128_m128_n128_w12_s2_causal"
    assert spec.out_dtype == "bfloat16" and spec.column_blocks == 1


def test_descale_errors_are_typed():
    ok = np.ones((2, 3), np.float32)
    with pytest.raises(InputTypeError, match="q_descale is not allowed with non-fp8 inputs"):
        check_descales({"q_descale": ok}, 2, 3, fp8=False)
    with pytest.raises(InputError, match=r"k_descale has shape \(3, 2\); expected \(2, 3\)"):
        check_descales({"k_descale": ok.T}, 2, 3, fp8=True)
    with pytest.raises(InputTypeError, match="v_descale has dtype int64"):
        check_descales({"v_descale": np.ones((2, 3), np.int64)}, 2, 3, fp8=True)


def test_fp8_specs_refuse_float_inputs_and_the_fp8_entry_refuses_other_specs():
    zeros = np.zeros((1, 1, 16, 128), np.float32)
    with pytest.raises(InputTypeError, match=r"use kernelgen\.calls\.emulated\.emulate_fp8"):
        emulate_attention(fp8_spec(), zeros, zeros, zeros)
    bf16 = spec_from_dict({**FP8_SPEC, "dtype": "bfloat16"})
    bits = np.zeros((1, 1, 16, 128), np.uint8)
    with pytest.raises(InputTypeError, match="spec dtype='bfloat16' is not allowed here"):
        emulate_fp8_attention(bf16, bits, bits, bits)
    with pytest.raises(InputTypeError, match="q has dtype float32"):
        emulate_fp8_attention(fp8_spec(), zeros, bits, bits)


def test_fp8_kernel_runs_under_the_race_check():
    """The emulator's race check covers the fp8 kernel: P V issued before the V^T tile's
    mbarrier wait (its TMA bytes read before they landed) is a HazardError."""
    spec = fp8_spec()
    source = render(spec)
    wait = "      mbarrier_wait(v_full + 8 * slot, phase);\n"
    assert source.count(wait) == 1
    q, k, v, descales = problem(5, 1, 1, 1, 16, 130)
    with pytest.raises(HazardError):
        emulate_fp8_attention(spec, q, k, v, source=source.replace(wait, ""), **descales)


def test_fp8_fragments_take_half_the_registers():
    """Q's A fragments and the overlap's P buffer hold 8-bit values (head_dim / 8 and
    block_n / 8 registers per thread), so fp8 takes Q in registers with the overlap at d128 and
    128-key tiles (160 of 160), which 16-bit operands exceed (192: docs/hopper.md)."""
    assert fp8_spec().accumulators_per_thread == 128
    assert fp8_spec(q_in_registers=True).accumulators_per_thread == 144
    both = fp8_spec(overlap=True, q_in_registers=True, stages=3)
    assert both.accumulators_per_thread == 160
    with pytest.raises(SpecError, match="need 192 fp32 accumulators per thread; at most 168"):
        spec_from_dict({**FP8_SPEC, "dtype": "bfloat16", "overlap": True, "q_in_registers": True,
                        "stages": 3})  # fmt: skip
