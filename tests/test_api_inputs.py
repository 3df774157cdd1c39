"""CPU tier: attention() input checks run on metadata and raise typed errors naming the argument.

Device arrays are stood in for by objects exposing __cuda_array_interface__ (never dereferenced).
"""

from __future__ import annotations

import numpy as np
import pytest

import kernelgen
from kernelgen.calls.attention import (
    check_inputs,
    check_num_splits,
    default_spec,
    describe,
    seqlens_k_array,
)
from kernelgen.errors import InputError, InputTypeError
from kernelgen.specs.forward import KernelSpec


class FakeDeviceArray:
    """Metadata-only stand-in for a CUDA array."""

    def __init__(self, shape, typestr="<f2", strides=None):
        self.__cuda_array_interface__ = {
            "shape": tuple(shape),
            "typestr": typestr,
            "strides": strides,
            "data": (0xDEAD0000, False),
            "version": 3,
        }


def infos(q=(2, 8, 17, 64), k=(2, 2, 33, 64), v=None, dtype="<f2", mask=None, **kw):
    v = k if v is None else v
    arrays = [describe(FakeDeviceArray(s, dtype), n) for s, n in ((q, "q"), (k, "k"), (v, "v"))]
    m = describe(FakeDeviceArray(mask, "<f4"), "mask") if mask is not None else None
    return arrays, m


def check(layout="bhsd", scale=None, spec=None, causal=False, **kw):
    arrays, mask = infos(**kw)
    return check_inputs(*arrays, mask, layout=layout, scale=scale, spec=spec, causal=causal)


def test_valid_call_with_gqa_and_broadcast_mask():
    call = check(mask=(1, 8, 17, 1))
    assert call.q.shape == (2, 8, 17, 64)
    assert call.scale == pytest.approx(1 / 8)
    assert call.dtype == "float16"


def test_bshd_layout_is_permuted_by_strides():
    call = check(q=(2, 17, 8, 64), k=(2, 33, 2, 64), layout="bshd")
    assert call.q.shape == (2, 8, 17, 64)
    assert call.q.strides == (17 * 8 * 64, 64, 8 * 64, 1)
    assert call.k.shape == (2, 2, 33, 64)


@pytest.mark.parametrize(
    ("kwargs", "error", "needle"),
    [
        ({"q": (8, 17, 64)}, InputError, "q has rank 3"),
        ({"dtype": "<f8"}, InputTypeError, "q has dtype float64"),
        ({"q": (2, 8, 0, 64)}, InputError, "q has a zero-size dimension"),
        ({"k": (3, 2, 33, 64)}, InputError, "k has batch 3 but q has batch 2"),
        ({"k": (2, 3, 33, 64)}, InputError, "not divisible by the 3 key/value heads"),
        ({"k": (2, 2, 33, 32)}, InputError, "k has head_dim 32 but q has head_dim 64"),
        ({"v": (2, 2, 34, 64)}, InputError, "k has shape (2, 2, 33, 64) but v has"),
        ({"q": (2, 8, 17, 60), "k": (2, 2, 33, 60)}, InputError, "head_dim 60"),
        ({"q": (2, 8, 17, 264), "k": (2, 2, 33, 264)}, InputError, "head_dim 264"),
        ({"mask": (2, 8, 17, 5)}, InputError, "not broadcastable"),
        ({"mask": (1, 1, 1, 1, 1)}, InputError, "mask has rank 5"),
        ({"layout": "sbhd"}, InputError, "layout='sbhd' is not allowed"),
        ({"scale": float("nan")}, InputError, "scale=nan is not allowed"),
    ],
)
def test_bad_inputs_raise_typed_errors(kwargs, error, needle):
    with pytest.raises(error) as info:
        check(**kwargs)
    assert needle in str(info.value)


def test_dtype_mismatch_names_the_argument():
    q = describe(FakeDeviceArray((1, 1, 4, 64), "<f2"), "q")
    k = describe(FakeDeviceArray((1, 1, 4, 64), "<f4"), "k")
    with pytest.raises(InputTypeError, match="k has dtype float32 but q has float16"):
        check_inputs(q, k, k, None, layout="bhsd", scale=None, spec=None, causal=False)


def test_non_contiguous_last_dim():
    q = describe(FakeDeviceArray((1, 1, 4, 64), "<f2", strides=(1024, 1024, 256, 4)), "q")
    k = describe(FakeDeviceArray((1, 1, 4, 64), "<f2"), "k")
    with pytest.raises(InputError, match="q's last dimension is not contiguous"):
        check_inputs(q, k, k, None, layout="bhsd", scale=None, spec=None, causal=False)


def test_host_arrays_are_described_and_other_objects_rejected():
    """NumPy arrays go to the CPU backend (kernelgen.runtime.host); lists are no arrays."""
    info = describe(np.zeros((1, 2, 3, 8), dtype=np.float16)[:, :, 1:], "q")
    assert (info.shape, info.strides, info.dtype) == ((1, 2, 2, 8), (48, 24, 8, 1), "float16")
    with pytest.raises(InputTypeError, match="NumPy array or CPU torch tensor"):
        describe([1, 2, 3], "k")


@pytest.mark.parametrize(
    ("field", "value", "needle"),
    [
        ("dtype", "bfloat16", "dtype='bfloat16' but the call needs dtype='float16'"),
        ("head_dim", 128, "head_dim=128 but the call needs head_dim=64"),
        ("causal", True, "causal=True but the call needs causal=False"),
    ],
)
def test_spec_that_disagrees_with_the_call(field, value, needle):
    base = dict(loop_order="v2", dtype="float16", head_dim=64, block_m=64, block_n=32)
    spec = KernelSpec(**{**base, field: value})
    with pytest.raises(InputError, match=needle.replace("(", "\\(")):
        check(spec=spec)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("head_dim", [8, 64, 80, 128, 256])
@pytest.mark.parametrize("arch", ["sm_80", "sm_86", "sm_90"])
def test_default_spec_fits_every_head_dim(dtype, head_dim, arch):
    spec = default_spec(dtype, head_dim, causal=True, arch=arch)
    assert (spec.dtype, spec.head_dim, spec.causal, spec.loop_order) == (
        dtype,
        head_dim,
        True,
        "v2",
    )
    assert spec.mma == ("mma_sync" if dtype != "float32" else "simt")
    simt = default_spec(dtype, head_dim, causal=True, arch=arch, tensor_cores=False)
    assert simt.mma == "simt"
    decode = default_spec(dtype, head_dim, causal=True, arch=arch, decode_rows=4)
    assert decode.split_kv and decode.pack_gqa == (dtype != "float32")
    simt_decode = default_spec(dtype, head_dim, True, arch, tensor_cores=False, decode_rows=4)
    assert simt_decode.split_kv and simt_decode.mma == "simt" and simt_decode.block_m == 16


def test_tensor_core_spec_needs_16_byte_strides():
    spec = KernelSpec(
        loop_order="v2", dtype="float16", head_dim=64, block_m=64, block_n=64, mma="mma_sync"
    )
    check(spec=spec)  # contiguous (B, H, S, 64) fp16: every stride a multiple of 8 elements
    q = describe(FakeDeviceArray((1, 1, 4, 64), "<f2", strides=(1000, 1000, 250, 2)), "q")
    k = describe(FakeDeviceArray((1, 1, 4, 64), "<f2"), "k")
    with pytest.raises(InputError, match=r"q has strides \(500, 500, 125, 1\).*multiples of 8"):
        check_inputs(q, k, k, None, layout="bhsd", scale=None, spec=spec, causal=False)


# ---- split-KV arguments ------------------------------------------------------------------

SPLIT_SPEC = default_spec("float16", 64, causal=False, arch="sm_90", decode_rows=4)


def test_decode_rows_choose_the_packed_split_spec():
    assert SPLIT_SPEC.pack_gqa and SPLIT_SPEC.split_kv and SPLIT_SPEC.num_warps == 1
    wide = default_spec("float16", 64, causal=False, arch="sm_90", decode_rows=40)
    assert wide.num_warps == 4 and wide.block_m == 64
    many = default_spec("float16", 64, causal=False, arch="sm_90", decode_rows=96)
    assert many.pack_gqa and many.split_kv and many.block_m == 64  # two tiles per K/V head
    prefill = default_spec("float16", 64, causal=False, arch="sm_90")
    assert not prefill.pack_gqa and not prefill.split_kv
    forced = default_spec("float16", 64, causal=False, arch="sm_90", split_kv=True)
    assert forced.split_kv and not forced.pack_gqa


@pytest.mark.parametrize(
    ("value", "spec", "error", "match"),
    [
        (0, None, InputError, r"num_splits=0 is not allowed; use 1 to 128"),
        (129, SPLIT_SPEC, InputError, r"num_splits=129 is not allowed"),
        (2.0, None, InputTypeError, r"num_splits has type float"),
        (True, None, InputTypeError, r"num_splits has type bool"),
        (4, default_spec("float16", 64, False, "sm_90"), InputError, r"needs a split-KV spec"),
    ],
)
def test_bad_num_splits(value, spec, error, match):
    with pytest.raises(error, match=match):
        check_num_splits(value, spec)


def test_good_num_splits():
    assert check_num_splits(None, None) is None
    assert check_num_splits(64, SPLIT_SPEC) == 64
    assert check_num_splits(1, default_spec("float16", 64, False, "sm_90")) == 1


@pytest.mark.parametrize(
    ("value", "error", "match"),
    [
        ([3, 4], InputError, r"seqlens_k has shape \(2,\); expected \(3,\)"),
        ([1, -1, 2], InputError, r"seqlens_k holds -1; allowed 0 to 50"),
        (np.array([1, 51, 2]), InputError, r"seqlens_k holds 51; allowed 0 to 50"),
        (np.array([1.0, 2.0, 3.0]), InputTypeError, r"seqlens_k has dtype float64"),
        (FakeDeviceArray((3,), "<i8"), InputTypeError, r"seqlens_k has dtype <i8; expected int32"),
        (FakeDeviceArray((3, 1), "<i4"), InputError, r"seqlens_k has shape \(3, 1\)"),
        (FakeDeviceArray((3,), "<i4", (8,)), InputError, r"seqlens_k has stride 2"),
    ],
)
def test_bad_seqlens_k(value, error, match):
    with pytest.raises(error, match=match):
        seqlens_k_array(value, batch=3, max_keys=50)


def test_bfloat16_crosses_dlpack_as_int16_where_a_library_refuses_it(monkeypatch):
    """A CuPy/torch pair without bfloat16 DLPack still hands torch bf16 bits to CuPy (a torch
    mask or seqlens_k of a CuPy call), via an int16 view."""
    import sys
    import types

    from kernelgen.runtime import frameworks as frameworks

    class Tensor:  # enough of torch.Tensor / cupy.ndarray for the exchange
        def __init__(self, dtype, origin):
            self.dtype, self.origin = dtype, origin

        def view(self, dtype):
            return Tensor(dtype, self.origin)

    def refusing_from_dlpack(x):
        if x.dtype in ("torch.bfloat16", "bfloat16", "float8_e4m3fn"):
            raise NotImplementedError(f"{x.dtype} is not supported")
        return Tensor(f"converted.{x.dtype}", x.origin)

    torch = types.ModuleType("torch")
    torch.int16, torch.bfloat16 = "torch.int16", "torch.bfloat16"
    torch.from_dlpack = refusing_from_dlpack
    ml_dtypes = types.ModuleType("ml_dtypes")
    ml_dtypes.bfloat16 = "ml.bfloat16"
    cupy = types.SimpleNamespace(
        ndarray=type(None), int16="cupy.int16", from_dlpack=refusing_from_dlpack
    )
    monkeypatch.setitem(sys.modules, "torch", torch)
    monkeypatch.setitem(sys.modules, "ml_dtypes", ml_dtypes)
    monkeypatch.setattr(frameworks, "import_cupy", lambda: cupy)

    tensor_in = Tensor("torch.bfloat16", "q")
    tensor_in.__class__.__module__ = "torch"
    on_device = frameworks.as_cupy(tensor_in)
    assert (on_device.dtype, on_device.origin) == ("ml.bfloat16", "q")  # the same memory
    fp8 = Tensor("float8_e4m3fn", "mask")
    fp8.__class__.__module__ = "torch"
    with pytest.raises(NotImplementedError):  # other dtypes are not papered over
        frameworks.as_cupy(fp8)


@pytest.mark.parametrize("value", ["no", "yes", 1, 0, None, 1.0])
@pytest.mark.parametrize("flag", ["causal", "return_lse", "validate"])
def test_flags_that_are_not_booleans_are_refused(flag, value):
    """A string such as causal="no" would read as true: every flag must be a bool."""
    q = np.zeros((1, 1, 4, 32), np.float16)
    for call in (
        lambda: kernelgen.attention(q, q, q, **{flag: value}),
        lambda: kernelgen.attention_with_kvcache(
            q.transpose(0, 2, 1, 3),
            q.transpose(0, 2, 1, 3),
            q.transpose(0, 2, 1, 3),
            [4],
            **{flag: value},
        ),
    ):
        with pytest.raises(kernelgen.InputTypeError, match=rf"{flag}=.* expected True or False"):
            call()
    if flag != "validate":
        with pytest.raises(kernelgen.InputTypeError, match=rf"{flag}="):
            kernelgen.attention_varlen(
                q[0, 0], q[0, 0], q[0, 0], [0, 4], [0, 4], 4, 4, **{flag: value}
            )
