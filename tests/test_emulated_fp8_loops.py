"""The fp8 (e4m3) wgmma forward's other loops on the emulator: Q in registers (the k32 e4m3 A
fragments read once from the swizzled Q tile), the overlapped loop (3 stages, with and without
Q in registers), ping-pong on the plain and the overlapped loop, against the float64 reference
of the quantized inputs with the element-wise bound of tests/test_emulated_fp8.py
(docs/hopper.md, "fp8"); and mutations of each loop that the bound or the emulator's checks
catch."""

from __future__ import annotations

import numpy as np
import pytest
from test_emulated_fp8 import SHAPES, bound_ratio, fp8_spec, problem, reference
from test_emulated_wgmma import PINGPONG_MUTATIONS

from kernelgen.calls.emulated import emulate_fp8_attention
from kernelgen.errors import EmulatorError, HazardError
from kernelgen.kernels.render import render
from kernelgen.references.fp8 import FP8_TOLERANCE

pytestmark = pytest.mark.emulate

SCALE = 128**-0.5
LOOPS = {
    "qr": {"q_in_registers": True},
    "ovl": {"overlap": True, "stages": 3},
    "ovl_qr": {"overlap": True, "q_in_registers": True, "stages": 3},
    "pp": {"pingpong": True},
    "ovl_pp": {"overlap": True, "pingpong": True, "stages": 3},
}


def run(spec, shape, seed, source=None):
    """The kernel on an fp8 problem of ``shape`` with descales: (max error / bound, relative
    Frobenius error, lse error)."""
    q, k, v, descales = problem(seed, *shape)
    result = emulate_fp8_attention(spec, q, k, v, source=source, **descales)
    ref, lse, a, b = reference(q, k, v, descales, spec.causal, SCALE)
    ratio = bound_ratio(result.out, ref, a, b)
    relative = float(np.linalg.norm(result.out - ref) / np.linalg.norm(ref))
    print(f"{spec.uri}: max error / bound {ratio:.3f}, relative Frobenius error {relative:.4f}")
    return ratio, relative, float(np.max(np.abs(result.lse - lse)))


# causal with GQA (Sq 70, Sk 150), not causal with MQA (Sq 131, Sk 200): lengths off the tiles
@pytest.mark.parametrize(("causal", "shape"), [(True, SHAPES[0]), (False, SHAPES[1])])
@pytest.mark.parametrize("loop", LOOPS)
def test_fp8_loops_within_the_stated_bound(loop, causal, shape):
    spec = fp8_spec(causal=causal, **LOOPS[loop])
    ratio, relative, lse_error = run(spec, shape, seed=7 + shape[4])
    assert ratio <= 1.0
    assert relative < FP8_TOLERANCE
    assert lse_error <= 1e-4


# Mutations the bound catches: the Q fragments' k halves swapped (register 2 and 3 read bytes
# 0-15 of the k-step, 0 and 1 bytes 16-31), Q read without the 128-byte swizzle, the overlapped
# loop not rescaling O when a row's reference moved.
BOUND_MUTATIONS = {
    "Q fragments' k halves swapped": (
        "qr",
        "const int byte = 32 * kk + 4 * (lane % 4) + 16 * (i / 2);",
        "const int byte = 32 * kk + 4 * (lane % 4) + 16 * (1 - i / 2);",
    ),
    "Q fragments read unswizzled": (
        "qr",
        "const int chunk = ((byte % ROW_BYTES) / 16) ^ swizzle_phase(row);",
        "const int chunk = ((byte % ROW_BYTES) / 16);",
    ),
    "overlap: O not rescaled": ("ovl", "if (moved) rescale_output(o, alpha);", ""),
}


@pytest.mark.parametrize("mutation", BOUND_MUTATIONS)
def test_fp8_loop_mutations_break_the_bound(mutation):
    loop, old, new = BOUND_MUTATIONS[mutation]
    spec = fp8_spec(**LOOPS[loop])
    source = render(spec)
    assert old in source
    ratio, _, _ = run(spec, (1, 2, 1, 64, 300), seed=3, source=source.replace(old, new))
    print(f"{mutation}: max error / bound {ratio:.2f}")
    assert ratio > 1.0


def test_fp8_overlap_without_the_wait_for_the_scores_is_a_hazard():
    """The overlapped fp8 loop reading S before its group retired (no wgmma.wait_group 1)."""
    spec = fp8_spec(**LOOPS["ovl_qr"])
    original = "wgmma_wait<1>();  // S of tile j + 1; tile j's P V may still run"
    source = render(spec)
    assert source.count(original) == 1
    with pytest.raises(HazardError, match="wgmma"):
        run(spec, (1, 1, 1, 16, 300), seed=5, source=source.replace(original, ""))


def test_fp8_pingpong_without_a_hand_over_deadlocks(monkeypatch):
    """Consumer 1 never hands the turn back: consumer 0 waits forever on its barrier (the
    emulator reports the deadlock; a short watchdog)."""
    monkeypatch.setenv("KG_EMULATOR_TIMEOUT", "10")
    spec = fp8_spec(**LOOPS["pp"])
    original, mutated = PINGPONG_MUTATIONS["no hand-over from consumer 1"]
    source = render(spec)
    assert source.count(original) == 1
    mutant = source.replace(original, mutated)
    with pytest.raises(EmulatorError):
        run(spec, (1, 1, 1, 128, 300), seed=6, source=mutant)
