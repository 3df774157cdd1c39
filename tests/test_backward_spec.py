"""CPU tier of the backward family's specs: the tensor-core engine's validation (one line per
problem), names, shared-memory formula and launch plan, the policy's engine choice, the API's
16-byte alignment check and the static model's pieces that need no compiler."""

from __future__ import annotations

import numpy as np
import pytest
import yaml

from kernelgen.calls import backward as backward_api
from kernelgen.errors import InputError
from kernelgen.families import backward, spec_of_family
from kernelgen.model.perfmodel import BACKWARD_INTERIOR, backward_interior_source, shared_bytes
from kernelgen.model.policy import default_backward_spec
from kernelgen.runtime.launch import Problem
from kernelgen.specs.backward import BackwardSpec

TC = {"family": "backward", "mma": "mma_sync", "dtype": "bfloat16", "head_dim": 128}
DEFAULT_TC = {**TC, "block_m": 64, "block_n": 128, "num_warps": 8}


def problems(**fields) -> str:
    with pytest.raises(ValueError) as caught:
        BackwardSpec(**fields)
    return str(caught.value)


def test_tensor_core_spec_defaults_name_and_shared_memory():
    spec = BackwardSpec(**DEFAULT_TC)
    assert spec.stages == 2
    assert spec.uri == "fa_bwd_tc_bf16_d128_m64_n128_w8_s2"
    assert (spec.key_warps, spec.dim_warps, spec.warp_queries, spec.warp_pairs) == (4, 2, 32, 4)
    # K, V: 2 x 128 rows; Q, dO: 2 stages x 2 x 64 rows (256 B each); P^T, dS^T: 2 x 128 x 64
    # 16-bit; two slots of 3 x 64 floats of statistics
    assert spec.smem_bytes == (2 * 128 + 4 * 64) * 256 + 2 * 128 * 64 * 2 + 2 * 3 * 64 * 4
    assert spec.kv_accumulators == 128 and spec.accumulators_per_thread == 192
    # rows are whole swizzle groups of 64 elements: head dim 96 takes 128-element rows
    assert BackwardSpec(**{**DEFAULT_TC, "head_dim": 96}).smem_row_elems == 128
    assert yaml.safe_load(spec.to_yaml())["stages"] == 2
    assert spec_of_family(yaml.safe_load(spec.to_yaml())) == spec


def test_cuda_core_specs_keep_their_names_and_dumps():
    spec = BackwardSpec(family="backward", dtype="float32", head_dim=64)
    assert spec.uri == "fa_bwd_simt_f32_d64_m32_n32_w4"
    assert "stages" not in yaml.safe_load(spec.to_yaml())
    assert "stages=2 is not allowed with mma='simt'" in problems(
        family="backward", dtype="float32", head_dim=64, stages=2
    )


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"dtype": "float32"}, "dtype='float32' is not allowed with mma='mma_sync'"),
        ({"stages": 3}, "stages=3 is not allowed with mma='mma_sync'; use one of 1, 2"),
        ({"block_n": 128, "num_warps": 2}, "block_n=128 needs a multiple of 4 warps"),
        ({"block_m": 128}, "split the query tile into 16 or 32 queries each; use block_m=32 or 64"),
        ({"head_dim": 256}, "256 dK and dV accumulators (at most 128)"),
        ({"head_dim": 256, "block_n": 64}, "use smaller block_m or block_n or stages: 1"),
        ({"block_n": 96}, "block_n=96 is not allowed with mma='mma_sync'; use one of 16, 32, 64"),
    ],
)
def test_tensor_core_spec_problems_are_one_line_each(fields, message):
    text = problems(**{**DEFAULT_TC, **fields})
    assert message in text
    assert all(len(line) < 300 for line in text.splitlines())


def test_deterministic_tensor_core_launches_its_own_dq_kernel():
    spec = BackwardSpec(**DEFAULT_TC, deterministic=True)
    problem = Problem(2, 4, 2, 100, 300, 128, (8, 8, 8), (8, 8, 8), (8, 8, 8), (8, 8, 8))
    steps = backward.launch_steps(spec, problem)
    assert [s.symbol for s in steps] == backward.symbols(spec)
    _, main, dq = steps
    assert main.grid == (3 * 2 * 2, 1, 1) and main.block == (256, 1, 1)
    assert main.shared_mem == spec.smem_bytes
    # 4 warps of 16 query rows per block, 64-key tiles in two stages
    assert dq.block == (128, 1, 1) and dq.grid == (2 * 2 * 4, 1, 1)
    assert dq.shared_mem == spec.dq_smem_bytes == (2 * 64 + 2 * 2 * 64) * 256
    assert backward.dq_params(spec) == backward.dq_params(spec.model_copy(update={"mma": "simt"}))


def test_split_roles_geometry_and_name():
    """Two warps per 32 keys, each over the whole query tile: one holds dV (and computes dQ for
    the whole tile, 64 x 32 per warp), the other dK, each of every column."""
    spec = BackwardSpec(**DEFAULT_TC, split_roles=True)
    assert spec.uri == "fa_bwd_tc_bf16_d128_m64_n128_w8_s2_split"
    assert (spec.key_warps, spec.dim_warps, spec.warp_pairs) == (4, 2, 8)
    assert spec.kv_accumulators == 128 and spec.accumulators_per_thread == 192
    assert (spec.dq_warps, spec.dq_m_tiles, spec.dq_row_warps, spec.dq_col_warps) == (4, 4, 1, 4)
    assert spec.dq_pairs == 2
    assert spec.smem_bytes == BackwardSpec(**DEFAULT_TC).smem_bytes  # the same tiles
    assert yaml.safe_load(spec.to_yaml())["split_roles"] is True
    assert "split_roles" not in yaml.safe_load(BackwardSpec(**DEFAULT_TC).to_yaml())
    assert spec_of_family(yaml.safe_load(spec.to_yaml())) == spec


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"block_n": 64}, "needs two warps per 32 keys: block_n=64 with num_warps=8 is not"),
        ({"softcap": True}, "softcap and score_mod (a per-score derivative) are not allowed"),
        ({"mma": "simt", "stages": None, "dtype": "float32", "block_m": 32, "block_n": 32},
         "split_roles=True needs mma='mma_sync'"),
        ({"split_roles": "yes"}, "split_roles"),
        # the fuzzer's find: 2 warps and 64 queries left rows 32-63 without lse and D (NaN in
        # the emulator's poisoned shared memory: every dK and dV); 32 queries are covered
        ({"block_m": 64, "block_n": 32, "num_warps": 2, "head_dim": 64},
         "block_m=64 is over their 32 threads with num_warps=2; use block_m=32"),
    ],
)  # fmt: skip
def test_split_roles_problems(fields, message):
    assert message in problems(**{**DEFAULT_TC, "split_roles": True, **fields})


def test_policy_picks_the_engine_and_the_tiling():
    spec = default_backward_spec("bfloat16", 128, causal=True)
    assert spec.uri == "fa_bwd_tc_bf16_d128_m64_n128_w8_s2_split_causal"
    # split roles up to head dim 128, not with variants (64-key blocks) nor above
    assert default_backward_spec("float16", 64, causal=False).split_roles
    windowed = default_backward_spec("bfloat16", 128, causal=False, variants=("window",))
    assert not windowed.split_roles
    assert not default_backward_spec("bfloat16", 192, causal=False).split_roles
    rich = default_backward_spec("float16", 128, causal=False, variants=("softcap",))
    assert (rich.mma, rich.block_n) == ("mma_sync", 64)
    assert default_backward_spec("bfloat16", 256, causal=False).stages == 1
    assert default_backward_spec("float32", 64, causal=False).mma == "simt"
    assert default_backward_spec("float16", 64, causal=False, tensor_cores=False).mma == "simt"
    for head_dim in range(8, 257, 8):  # every head dim gets a valid spec
        assert default_backward_spec("float16", head_dim, causal=True).mma == "mma_sync"
    # a device's own arch: sm_86's 99 KiB take the 64-key tiling with one stage at head dim 128,
    # and the CUDA cores above; sm_90 alone as for both
    assert default_backward_spec("float16", 128, causal=True, arch="sm_86").uri.endswith(
        "d128_m64_n64_w8_s1_causal"
    )
    assert default_backward_spec("float16", 256, causal=True, arch="sm_86").mma == "simt"
    assert default_backward_spec("float16", 128, causal=True, arch="sm_90").archs == ("sm_90",)


def _call(q_strides_from=None):
    q = np.zeros((1, 2, 8, 32), np.float16)
    if q_strides_from is not None:
        q = q_strides_from[..., :32]
    infos = [backward_api.describe(x, n) for x, n in ((q, "q"), (q[:, :1], "k"), (q[:, :1], "v"))]
    call = backward_api.check_inputs(
        *infos, None, layout="bhsd", scale=None, spec=None, causal=False,
        variants=backward_api.VariantArgs(),
    )  # fmt: skip
    return call, infos


def test_misaligned_inputs_fall_back_to_cuda_cores_or_refuse_a_tensor_core_spec():
    call, infos = _call()
    assert backward_api._misaligned(infos) == []
    assert backward_api._policy_spec(call, False, False, 80, []).mma == "mma_sync"
    wide = np.zeros((1, 2, 8, 36), np.float16)  # rows of 36 elements: not multiples of 8
    call, infos = _call(wide)
    misaligned = backward_api._misaligned(infos)
    assert misaligned and "multiples of 8" in misaligned[0]
    assert backward_api._policy_spec(call, False, False, 80, misaligned).mma == "simt"
    assert backward_api._policy_spec(call, False, False, 75, []).mma == "simt"
    spec = BackwardSpec(**{**TC, "dtype": "float16", "head_dim": 32, "block_m": 32,
                           "block_n": 32, "num_warps": 2})  # fmt: skip
    with pytest.raises(InputError, match="copies 16-byte chunks"):
        backward_api._checked_spec(spec, call, False, False, misaligned)


def test_shared_bytes_by_instruction_width():
    assert shared_bytes("LDSM.16.M88.4") == shared_bytes("LDSM.16.MT88.4") == 512
    assert shared_bytes("LDSM.16.M88.2") == 256 and shared_bytes("LDSM.16.M88") == 128
    assert shared_bytes("LDGSTS.E.BYPASS.128") == 512
    assert shared_bytes("STS.128") == 512 and shared_bytes("STS.64") == 256
    assert shared_bytes("STS") == shared_bytes("LDS") == 128
    assert shared_bytes("HMMA.16816.F32.BF16") == 0


@pytest.mark.parametrize("deterministic", [False, True])
def test_interior_variant_replaces_each_test_of_the_main_loop(deterministic):
    spec = BackwardSpec(**DEFAULT_TC, causal=True, deterministic=deterministic)
    source = backward_interior_source(backward.render(spec), deterministic)
    assert not any(test in source for test in BACKWARD_INTERIOR)
    assert "if (true) {" in source
