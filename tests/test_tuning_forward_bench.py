"""The forward tuner's bench (kernelgen.tuning.gpu.CupyBench) on a problem with the built-in
variants, run by the emulator over NumPy: the kernels get the variants' values (per-head sinks
and ALiBi slopes, the window and the soft cap; a kernel with sinks or ALiBi reads its arrays,
which were once left null), and its check is against float64 with those values."""

from __future__ import annotations

import dataclasses

import pytest
from test_tuning_backward import numpy_cupy

from kernelgen.specs.forward import spec_from_dict
from kernelgen.tuning import candidates as candidates_module
from kernelgen.tuning import gpu
from kernelgen.tuning.key import DeviceInfo, ProblemDesc

pytestmark = pytest.mark.emulate

VARIANTS = ("window", "softcap", "alibi", "sinks")


@pytest.fixture
def bench(monkeypatch):
    """A CupyBench over NumPy (GQA 2, Sq != Sk, causal, every variant, float32) whose kernels
    the emulator runs."""
    from kernelgen.runtime import launch
    from kernelgen.runtime.host import emulated_kernel

    monkeypatch.setattr(gpu, "require_device", numpy_cupy)
    monkeypatch.setattr(launch, "runtime_kernel", lambda spec, cubin=None: emulated_kernel(spec))
    monkeypatch.setattr(candidates_module, "offline_cubin", lambda spec, arch: None)
    problem = ProblemDesc("float32", 1, 2, 1, 40, 48, 16, causal=True, variants=VARIANTS)
    return gpu.CupyBench(problem, DeviceInfo("Emulated", "8.0", 108))


def test_the_forward_bench_runs_variants_with_their_values(bench):
    values = dict(bench.launch_problem.variant_scalars)
    assert values == {"window_left": 12, "window_right": 0, "softcap": gpu.BENCH_SOFTCAP}
    assert all(s["sinks"].shape == (2,) and s["alibi_slopes"].shape == (2,) for s in bench.sets)
    spec = spec_from_dict(
        {"loop_order": "v2", "mma": "simt", "dtype": "float32", "head_dim": 16, "block_m": 16,
         "block_n": 16, "num_warps": 2, "causal": True, **dict.fromkeys(VARIANTS, True)}
    )  # fmt: skip
    bench.compile(spec)
    assert gpu.check_rows(bench.problem) == 40  # the slice holds every row
    assert bench.check(spec) is None  # against float64 with the variants' values
    # the check sees the values: the same kernel run with another soft cap is wrong
    bench.launch_problem = dataclasses.replace(
        bench.launch_problem, variant_scalars=(("window_left", 12), ("window_right", 0),
                                               ("softcap", 2.0))
    )  # fmt: skip
    problem = bench.check(spec)
    assert problem is not None and problem.endswith("(float64)")
