"""CPU tier: a repeated attention() call takes its remembered plan, and only when nothing that
decides the launches has changed. CuPy is replaced by kernelgen/testing/fake_cupy (no GPU,
nothing runs); the launches are recorded."""

from __future__ import annotations

import sys

import numpy as np
import pytest
from conftest import install_fake_libraries

import kernelgen
from kernelgen.calls import attention as api
from kernelgen.runtime import launch as launch
from kernelgen.runtime.launch import clear_kernel_cache
from kernelgen.testing import fake_cupy
from kernelgen.tuning import clear_memo


@pytest.fixture
def recorded(monkeypatch, tuning_sandbox):
    """Launches as (symbol, grid, block, args, shared_mem); a fake CuPy; no tuning (heuristic);
    check_inputs counted."""
    launches: list[tuple] = []
    install_fake_libraries(monkeypatch, lambda *launch: launches.append(launch))
    # a fake A100: untuned calls run the pointer kernels, whose arguments these tests follow
    # (the wgmma kernels' tensor maps: test_call_plans.py's Hopper test)
    monkeypatch.setattr(fake_cupy, "COMPUTE_CAPABILITY", "80")
    checks = []
    real_check = api.check_inputs
    monkeypatch.setattr(
        api, "check_inputs", lambda *a, **kw: checks.append(1) or real_check(*a, **kw)
    )
    yield launches, checks
    clear_kernel_cache()


def qkv(batch=2, heads=4, kv_heads=2, seqlen_q=100, seqlen_k=120, head_dim=64, dtype=np.float16):
    q = fake_cupy.ndarray((batch, heads, seqlen_q, head_dim), dtype)
    k = fake_cupy.ndarray((batch, kv_heads, seqlen_k, head_dim), dtype)
    v = fake_cupy.ndarray((batch, kv_heads, seqlen_k, head_dim), dtype)
    return q, k, v


def pointer(arg):
    return arg.data.ptr if isinstance(arg, fake_cupy.ndarray) else arg


def test_a_repeated_call_reuses_its_plan_with_the_new_arrays(recorded):
    launches, checks = recorded
    first = qkv()
    out1 = kernelgen.attention(*first, causal=True)
    second = qkv()
    out2, lse2 = kernelgen.attention(*second, causal=True, return_lse=True)
    assert len(checks) == 1  # the second call skipped the checks and the spec choice
    assert len(launches) == 2
    (sym1, grid1, block1, args1, smem1), (sym2, grid2, block2, args2, smem2) = launches
    assert (sym1, grid1, block1, smem1) == (sym2, grid2, block2, smem2)
    assert out2.shape == out1.shape == first[0].shape and lse2.shape == first[0].shape[:3]
    # Same scalars, the second call's tensors where the first call's were.
    swap = {pointer(a): pointer(b) for a, b in zip((*first, out1), (*second, out2), strict=True)}
    expected = [swap.get(pointer(a), pointer(a)) for a in args1]
    at_lse = [pointer(a) for a in args2].index(pointer(lse2))
    assert int(args1[at_lse]) == 0  # the first call did not ask for the lse: null, no allocation
    expected[at_lse] = pointer(lse2)
    assert [pointer(a) for a in args2] == expected
    others = [i for i in range(len(args1)) if i != at_lse]
    assert [type(args2[i]) for i in others] == [type(args1[i]) for i in others]


@pytest.mark.parametrize(
    "change",
    ["causal", "scale", "shape", "dtype", "misaligned", "autotune", "memo", "num_splits", "spec"],
)
def test_anything_that_decides_the_launches_takes_the_checked_path(recorded, monkeypatch, change):
    _, checks = recorded
    kernelgen.attention(*qkv())
    q, k, v = qkv()
    options: dict = {}
    if change == "causal":
        options["causal"] = True
    elif change == "scale":
        options["scale"] = 0.5
    elif change == "shape":
        q, k, v = qkv(seqlen_q=101)
    elif change == "dtype":
        q, k, v = qkv(dtype=np.float32)
    elif change == "misaligned":
        q = fake_cupy.ndarray(q.shape, q.dtype, offset=8)
    elif change == "autotune":
        monkeypatch.setenv("KERNELGEN_AUTOTUNE", "off")
    elif change == "memo":
        clear_memo()
    elif change == "num_splits":
        options["num_splits"] = 2
    elif change == "spec":
        options["spec"] = api.default_spec("float16", 64, False, "sm_90", tensor_cores=False)
    kernelgen.attention(q, k, v, **options)
    assert len(checks) == 2
    kernelgen.attention(q, k, v, **options)  # and that call's plan is remembered in turn
    assert len(checks) == 2


def test_masks_are_checked_every_call(recorded):
    _, checks = recorded
    q, k, v = qkv()
    mask = fake_cupy.ndarray((1, 1, q.shape[2], k.shape[2]), np.float32)
    for _ in range(2):
        kernelgen.attention(q, k, v, mask=mask)
    assert len(checks) == 2


@pytest.mark.parametrize("host", [list, tuple, np.asarray], ids=["list", "tuple", "numpy"])
def test_host_lengths_take_the_plan_and_are_checked_and_uploaded_every_call(
    recorded, monkeypatch, host
):
    launches, checks = recorded
    uploads = []
    cupy = sys.modules["cupy"]  # the recording fake
    real_asarray = cupy.asarray
    monkeypatch.setattr(cupy, "asarray", lambda x: uploads.append(x) or real_asarray(x))
    q, k, v = qkv()
    for lengths in ([120, 7], [0, 120]):
        kernelgen.attention(q, k, v, seqlens_k=host(lengths))
    assert len(checks) == 1 and len(launches) == 2  # the second call took the plan
    assert [list(u) for u in uploads] == [[120, 7], [0, 120]]  # each call's own values
    assert all(u.dtype == np.int32 for u in uploads)
    for bad, error, match in (
        ([121, 0], kernelgen.InputError, "121"),
        ([1, 2, 3], kernelgen.InputError, "shape"),
        ([1.5, 2.0], kernelgen.InputTypeError, "dtype"),
    ):
        with pytest.raises(error, match=match):
            kernelgen.attention(q, k, v, seqlens_k=host(bad))
    assert len(launches) == 2  # refused before any launch


def test_bad_input_still_raises_after_a_good_call(recorded):
    launches, _ = recorded
    q, k, v = qkv()
    kernelgen.attention(q, k, v)
    with pytest.raises(kernelgen.InputError, match="scale"):
        kernelgen.attention(q, k, v, scale=float("nan"))
    bad_k = fake_cupy.ndarray((2, 3, 120, 64), np.float16)  # 4 heads over 3 K/V heads
    with pytest.raises(kernelgen.InputError):
        kernelgen.attention(q, bad_k, bad_k)
    assert len(launches) == 1


TC_FIELDS = {"loop_order": "v2", "mma": "mma_sync", "dtype": "float16", "num_warps": 4}


@pytest.mark.parametrize(
    ("limits", "fields", "message"),
    [
        (
            launch.DeviceLimits(capability=75, sm_count=40, smem_optin=65536),
            {"head_dim": 64, "block_m": 64, "block_n": 64, "stages": 2},
            r"mma=mma_sync, which needs compute capability 80 or newer; device 0 is sm_75",
        ),
        (
            launch.DeviceLimits(capability=89, sm_count=128, smem_optin=101376),  # RTX 4090
            {"head_dim": 256, "block_m": 64, "block_n": 32, "stages": 3, "smem_layout": "padded"},
            r"needs 135168 bytes of shared memory per block; device 0 \(sm_89\) allows at most "
            r"101376",
        ),
        (  # Hopper's wgmma kernels run on compute capability 9.0 only: not on an A100 ...
            launch.DeviceLimits(capability=80, sm_count=108, smem_optin=166912),
            {"mma": "wgmma", "head_dim": 64, "block_m": 64, "block_n": 64, "num_warps": 8},
            r"mma=wgmma, compiled for sm_90a, which runs only on compute capability 9.0 \(H100, "
            r"H200\); device 0 is sm_80: use an mma_sync spec",
        ),
        (  # ... nor on a B200
            launch.DeviceLimits(capability=100, sm_count=148, smem_optin=232448),
            {"mma": "wgmma", "head_dim": 64, "block_m": 64, "block_n": 64, "num_warps": 8},
            r"mma=wgmma, compiled for sm_90a, .* device 0 is sm_100",
        ),
    ],
)
def test_a_spec_the_device_cannot_run_is_an_input_error(
    recorded, monkeypatch, limits, fields, message
):
    from kernelgen.errors import InputError
    from kernelgen.specs.forward import spec_from_dict

    launches, _ = recorded
    spec = spec_from_dict({**TC_FIELDS, **fields})
    monkeypatch.setattr(launch, "_device_limits", lambda device: limits)
    with pytest.raises(InputError, match=message):
        kernelgen.attention(*qkv(head_dim=spec.head_dim), spec=spec)
    assert launches == []


def test_variant_values_are_part_of_the_plan(recorded):
    """A call with other variant values (or arrays of another shape) never reuses a plan made
    for different ones; the same values reuse it with the new slope and sink arrays."""
    launches, checks = recorded
    slopes = fake_cupy.ndarray((4,), np.float32)
    kernelgen.attention(*qkv(), causal=True, window_size=(8, 0), alibi_slopes=slopes)
    kernelgen.attention(*qkv(), causal=True, window_size=(9, 0), alibi_slopes=slopes)
    assert len(checks) == 2  # another window: the checked path
    new_slopes = fake_cupy.ndarray((4,), np.float32)
    kernelgen.attention(*qkv(), causal=True, window_size=(9, 0), alibi_slopes=new_slopes)
    assert len(checks) == 2  # the same values: the plan, with the new slopes
    assert pointer(new_slopes) in [pointer(a) for a in launches[-1][3]]
    assert pointer(slopes) not in [pointer(a) for a in launches[-1][3]]
    kernelgen.attention(
        *qkv(), causal=True, window_size=(9, 0), alibi_slopes=fake_cupy.ndarray((2, 4), np.float32)
    )
    assert len(checks) == 3  # (B, H) slopes: another plan (a batch stride)
    windows = [[int(x) for x in args[-4:-2]] for _, _, _, args, _ in launches]
    assert windows == [[8, 0], [9, 0], [9, 0], [9, 0]]


def test_an_untuned_call_on_a_9_0_device_runs_the_hopper_kernel_with_its_tensor_maps(
    monkeypatch, tuning_sandbox
):
    """On an H100 (the fakes' default device) the untuned prefill spec is the wgmma kernel: its
    q, k and v travel as 128-byte tensor maps, encoded for each call's arrays; a repeated call
    takes the plan and encodes the new arrays' maps."""
    from kernelgen.runtime.tensor_maps import TENSOR_MAP_DTYPE

    launches: list[tuple] = []
    install_fake_libraries(monkeypatch, lambda *launch: launches.append(launch))
    first, second = qkv(), qkv()
    kernelgen.attention(*first, causal=True)
    kernelgen.attention(*second, causal=True)
    (sym1, _, block1, args1, _), (sym2, _, _, args2, _) = launches
    assert sym1 == sym2 and sym1.startswith("fa_fwd_v2_wg_f16_d64_m128_n128_w12")
    assert block1 == (384, 1, 1)  # a producer and two consumer warpgroups
    for args, arrays in ((args1, first), (args2, second)):
        maps = [a for a in args if isinstance(a, np.ndarray) and a.dtype == TENSOR_MAP_DTYPE]
        assert [int(m["opaque"][0][0]) for m in maps] == [pointer(x) for x in arrays]
        assert all(m.nbytes == 128 for m in maps)
