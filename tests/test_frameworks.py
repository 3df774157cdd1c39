"""CPU tier: where a call runs. Torch calls launch on torch's current stream of q's device with
torch-allocated outputs and raw pointers; every call runs with its inputs' device current; inputs
on different devices are refused. CuPy and torch are the fakes of kernelgen/testing/ (nothing
runs on a GPU); launches are recorded with the device and stream current at launch time."""

from __future__ import annotations

import math

import numpy as np
import pytest
from conftest import install_fake_libraries, launched_kernel

import kernelgen
from kernelgen.calls import attention as api
from kernelgen.kernels.render import kernel_params
from kernelgen.runtime.launch import clear_kernel_cache
from kernelgen.testing import fake_cupy, fake_torch


@pytest.fixture
def recorded(monkeypatch, tuning_sandbox):
    """Launches as dicts (symbol, device, stream, args); fake CuPy and torch; no tuning."""
    launches: list[dict] = []

    def launch(symbol, grid, block, args, shared_mem):
        launches.append(
            {
                "symbol": symbol,
                "device": fake_cupy.CURRENT["device"],
                "stream": fake_cupy.CURRENT["stream"],
                "args": args,
            }
        )

    install_fake_libraries(monkeypatch, launch)
    # a fake A100: untuned calls run the pointer kernels, whose arguments these tests follow
    # (the wgmma kernels' tensor maps: test_call_plans.py's Hopper test)
    monkeypatch.setattr(fake_cupy, "COMPUTE_CAPABILITY", "80")
    yield launches
    clear_kernel_cache()


def torch_qkv(device=0, seqlen_q=100, seqlen_k=120, dtype=None):
    dtype = dtype or fake_torch.float16
    q = fake_torch.Tensor((2, 4, seqlen_q, 64), dtype, device)
    k = fake_torch.Tensor((2, 2, seqlen_k, 64), dtype, device)
    v = fake_torch.Tensor((2, 2, seqlen_k, 64), dtype, device)
    return q, k, v


def args_by_name(launch: dict) -> dict:
    """A recorded launch's arguments by kernel parameter name (main kernel or combine)."""
    _, params = launched_kernel(launch["symbol"])
    return {p.name: a for p, a in zip(params, launch["args"], strict=True)}


def test_a_torch_call_launches_on_torchs_stream_with_torch_outputs(recorded):
    fake_torch.STREAMS[1] = 0xBEEF
    q, k, v = torch_qkv(device=1)
    out, lse = kernelgen.attention(q, k, v, causal=True, return_lse=True)
    assert isinstance(out, fake_torch.Tensor) and isinstance(lse, fake_torch.Tensor)
    assert (out.shape, out.dtype, out.get_device()) == (q.shape, q.dtype, 1)
    assert (lse.shape, lse.dtype) == (q.shape[:3], fake_torch.float32)
    (launch,) = recorded
    assert (launch["device"], launch["stream"]) == (1, 0xBEEF)
    args = args_by_name(launch)
    for name, tensor in (("q", q), ("k", k), ("v", v), ("out", out), ("lse", lse)):
        assert type(args[name]) is np.uint64 and int(args[name]) == tensor.data_ptr(), name
    # the call left CuPy's current device and stream as it found them
    assert fake_cupy.CURRENT == {"device": 0, "stream": 0}


def test_a_repeated_torch_call_takes_its_plan_on_the_current_stream(recorded, monkeypatch):
    checks = []
    real_check = api.check_inputs
    monkeypatch.setattr(
        api, "check_inputs", lambda *a, **kw: checks.append(1) or real_check(*a, **kw)
    )
    kernelgen.attention(*torch_qkv())
    fake_torch.STREAMS[0] = 0xCAFE  # the caller switched streams between the calls
    q, k, v = torch_qkv()
    out = kernelgen.attention(q, k, v)
    assert len(checks) == 1
    assert [launch["stream"] for launch in recorded] == [0, 0xCAFE]
    args = args_by_name(recorded[1])
    assert [int(args[n]) for n in ("q", "k", "v", "out")] == [t.data_ptr() for t in (q, k, v, out)]


def test_split_kv_partials_of_a_torch_call_share_one_torch_allocation(recorded):
    q, k, v = torch_qkv(seqlen_q=1, seqlen_k=4096)
    logged = len(fake_torch.LOG)
    out = kernelgen.attention(q, k, v, num_splits=8)
    assert [launch["symbol"].endswith("_combine") for launch in recorded] == [False, True]
    main, combine = (args_by_name(launch) for launch in recorded)
    new = fake_torch.LOG[logged:]
    scratch, *rest = [a for a in new if a.dtype is fake_torch.float32]
    assert rest == [] and [a.ptr for a in new if a.dtype is not fake_torch.float32] == [
        out.data_ptr()
    ]
    start = scratch.ptr
    end = start + 4 * math.prod(scratch.shape)
    places = []
    for name in ("o_partial", "lse_partial"):
        assert int(main[name]) == int(combine[name]), name
        assert start <= int(main[name]) < end and int(main[name]) % 256 == start % 256, name
        places.append(int(main[name]))
    rows = q.shape[0] * q.shape[1] * q.shape[2]
    assert places[1] - places[0] >= 4 * 8 * rows * q.shape[3]  # o_partial fits before lse_partial
    assert end - places[1] >= 4 * 8 * rows
    assert int(combine["lse"]) == 0  # not asked for: not allocated, and the kernel skips it
    assert {launch["stream"] for launch in recorded} == {0}


def test_a_broadcast_torch_mask_is_converted_by_torch(recorded):
    q, k, v = torch_qkv()
    mask = fake_torch.Tensor((1, 1, 100, 120), fake_torch.float16)
    kernelgen.attention(q, k, v, mask=mask)
    args = args_by_name(recorded[0])
    converted = next(a for a in fake_torch.LOG if a.ptr == int(args["mask"]))
    assert converted.ptr != mask.data_ptr() and converted.dtype is fake_torch.float32
    strides = [int(args[f"mask_stride_{d}"]) for d in ("b", "h", "q", "k")]
    assert strides == [0, 0, 120, 1]


def test_host_lengths_of_a_torch_call_upload_on_torchs_stream(recorded):
    fake_torch.STREAMS[0] = 0xF00D
    q, k, v = torch_qkv(seqlen_q=1)
    kernelgen.attention(q, k, v, seqlens_k=[120, 3])
    launch = recorded[0]
    assert launch["stream"] == 0xF00D
    assert type(args_by_name(launch)["seqlens_k"]) is np.uint64


def test_cupy_arrays_run_on_their_own_device(recorded):
    q, k, v = (
        fake_cupy.ndarray(shape, np.float16, device=1)
        for shape in ((2, 4, 100, 64), (2, 2, 120, 64), (2, 2, 120, 64))
    )
    out = kernelgen.attention(q, k, v)
    out_again = kernelgen.attention(q, k, v)  # the remembered plan
    assert [launch["device"] for launch in recorded] == [1, 1]
    assert out.device.id == out_again.device.id == 1
    assert fake_cupy.CURRENT["device"] == 0
    assert args_by_name(recorded[0])["q"] is q


@pytest.mark.parametrize("framework", ["cupy", "torch"])
@pytest.mark.parametrize("odd_one", ["k", "v", "mask", "seqlens_k"])
def test_inputs_on_two_devices_are_refused(recorded, framework, odd_one):
    if framework == "torch":
        made = {
            "q": fake_torch.Tensor((2, 4, 1, 64), fake_torch.float16, 0),
            "k": fake_torch.Tensor((2, 2, 120, 64), fake_torch.float16, 0),
            "v": fake_torch.Tensor((2, 2, 120, 64), fake_torch.float16, 0),
        }
        mask = fake_torch.Tensor((1, 1, 1, 120), fake_torch.float32, 1 if odd_one == "mask" else 0)
        lengths = fake_torch.Tensor((2,), fake_torch.int32, 1 if odd_one == "seqlens_k" else 0)
        if odd_one in ("k", "v"):
            made[odd_one] = fake_torch.Tensor(made[odd_one].shape, fake_torch.float16, 1)
    else:
        shapes = {"q": (2, 4, 1, 64), "k": (2, 2, 120, 64), "v": (2, 2, 120, 64)}
        made = {
            name: fake_cupy.ndarray(shape, np.float16, device=int(name == odd_one))
            for name, shape in shapes.items()
        }
        mask = fake_cupy.ndarray((1, 1, 1, 120), np.float32, device=int(odd_one == "mask"))
        lengths = fake_cupy.ndarray((2,), np.int32, device=int(odd_one == "seqlens_k"))
    options = {"mask": mask} if odd_one == "mask" else {}
    if odd_one == "seqlens_k":
        options["seqlens_k"] = lengths
    with pytest.raises(kernelgen.InputError, match=f"{odd_one} is on CUDA device 1 but q is on"):
        kernelgen.attention(made["q"], made["k"], made["v"], **options)
    assert recorded == []


def test_a_cpu_torch_tensor_beside_cuda_ones_is_refused_by_name(recorded):
    """CPU tensors go to the CPU backend, but not mixed with CUDA ones."""
    q, k, v = torch_qkv()
    cpu_k = fake_torch.Tensor(k.shape, k.dtype, device_index=-1)
    with pytest.raises(kernelgen.InputTypeError, match="k is on the CPU but q is on CUDA device"):
        kernelgen.attention(q, cpu_k, v)


def test_kernel_params_name_the_mask_strides():
    """The names args_by_name relies on."""
    spec = api.default_spec("float16", 64, False, "sm_90", tensor_cores=True)
    names = [p.name for p in kernel_params(spec)]
    assert {"q", "k", "v", "out", "lse", "mask", "seqlens_k"} <= set(names)
    assert [f"mask_stride_{d}" for d in "bhqk"] == [n for n in names if n.startswith("mask_s")]
