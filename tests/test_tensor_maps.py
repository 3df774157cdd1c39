"""CPU tier: the TMA tensor maps of the wgmma kernels (kernelgen.runtime.tensor_maps): their layouts
from a call shape, the driver's stride rule as a typed error, one encode per tensor address,
and the device checks of wgmma specs."""

from __future__ import annotations

import numpy as np
import pytest

from kernelgen.errors import InputError
from kernelgen.runtime.launch import Problem
from kernelgen.runtime.tensor_maps import (
    TensorMapCache,
    check_address,
    device_pointer,
    tensor_map_layouts,
)
from kernelgen.specs.forward import spec_from_dict

SPEC = spec_from_dict(
    {"loop_order": "v2", "mma": "wgmma", "dtype": "bfloat16", "head_dim": 96}
    | {"block_m": 128, "block_n": 64}
)


def problem(q_strides=(4 * 100 * 96, 100 * 96, 96), kv_strides=(2 * 300 * 96, 300 * 96, 96)):
    return Problem(
        batch=3,
        num_heads=4,
        num_kv_heads=2,
        seqlen_q=100,
        seqlen_k=300,
        head_dim=96,
        q_strides=q_strides,
        k_strides=kv_strides,
        v_strides=kv_strides,
        out_strides=q_strides,
    )


def test_layouts_are_4d_innermost_first_with_byte_strides_and_tile_boxes():
    layouts = tensor_map_layouts(SPEC, problem())
    assert set(layouts) == {"q_map", "k_map", "v_map"}
    q, k = layouts["q_map"], layouts["k_map"]
    assert (q.tensor, q.data_type) == ("q", "bfloat16")
    assert q.dims == (96, 100, 4, 3) and k.dims == (96, 300, 2, 3)
    assert q.strides_bytes == (192, 100 * 192, 4 * 100 * 192)
    assert q.box == (64, 128, 1, 1) and k.box == (64, 64, 1, 1)  # block_m / block_n rows
    assert layouts["v_map"].strides_bytes == k.strides_bytes
    assert q.element_strides == (1, 1, 1, 1)


def test_bshd_strides_map_the_same_tensor():
    """(B, S, H, D) memory: the sequence stride is H * D, the head stride D."""
    layouts = tensor_map_layouts(SPEC, problem(q_strides=(100 * 4 * 96, 96, 4 * 96)))
    assert layouts["q_map"].strides_bytes == (4 * 96 * 2, 96 * 2, 100 * 4 * 96 * 2)


def test_the_tma_epilogue_maps_out_with_seqlen_q_rows_and_64_row_boxes():
    """epilogue: tma adds out_map: out's own strides (bhsd or bshd), its row extent the
    call's seqlen_q (the store clips rows past it), one consumer warpgroup's 64 rows a box."""
    spec = SPEC.model_copy(update={"epilogue": "tma"})
    bshd = (100 * 4 * 96, 96, 4 * 96)
    layouts = tensor_map_layouts(spec, Problem(**{**problem().__dict__, "out_strides": bshd}))
    assert set(layouts) == {"q_map", "k_map", "v_map", "out_map"}
    out = layouts["out_map"]
    assert (out.tensor, out.data_type) == ("out", "bfloat16")
    assert out.dims == (96, 100, 4, 3) and out.box == (64, 64, 1, 1)
    assert out.strides_bytes == (4 * 96 * 2, 96 * 2, 100 * 4 * 96 * 2)
    assert layouts["q_map"].strides_bytes == (192, 100 * 192, 4 * 100 * 192)  # q stays bhsd
    odd = Problem(**{**problem().__dict__, "out_strides": (4 * 100 * 100, 100 * 100, 100)})
    with pytest.raises(InputError, match="out: strides"):
        tensor_map_layouts(spec, odd)


def test_packed_gqa_maps_q_as_5d_boxes_of_whole_queries():
    """Packed GQA: q is (head dim, head in the group, query, K/V head, batch), so a box of
    (64, group, block_m / group) rows is the packed order query * group + head."""
    spec = SPEC.model_copy(update={"pack_gqa": True})
    q = tensor_map_layouts(spec, problem())["q_map"]  # group 2
    head, seq, batch = 100 * 192, 192, 4 * 100 * 192
    assert q.dims == (96, 2, 100, 2, 3)
    assert q.strides_bytes == (head, seq, 2 * head, batch)
    assert q.box == (64, 2, 64, 1, 1) and q.element_strides == (1,) * 5


def test_the_tma_epilogue_of_the_decode_and_fp8_forms():
    """Packed GQA: out_map is 5-d like q's, its 64-row box (64, group, 64 / group); a group of
    128 stores half of one query's heads. Split-KV: out_map maps the fp32 o_partial (split,
    B, H, Sq, D) with split and batch as one dimension, 32-column boxes. fp8: out is bf16,
    so its box is 64 columns (fp8 Q's is 128) and its strides are in bf16 elements."""
    tma = {"epilogue": "tma"}
    packed = tensor_map_layouts(SPEC.model_copy(update={"pack_gqa": True, **tma}), problem())
    out, head, seq, batch = packed["out_map"], 100 * 192, 192, 4 * 100 * 192
    assert (out.tensor, out.dims, out.box) == ("out", (96, 2, 100, 2, 3), (64, 2, 32, 1, 1))
    assert out.strides_bytes == (head, seq, 2 * head, batch)
    mqa = Problem(**{**problem().__dict__, "num_heads": 128, "num_kv_heads": 1})
    wide = tensor_map_layouts(SPEC.model_copy(update={"pack_gqa": True, **tma}), mqa)
    assert wide["out_map"].box == (64, 64, 1, 1, 1) and wide["q_map"].box == (64, 128, 1, 1, 1)
    split_spec = SPEC.model_copy(update={"split_kv": True, **tma})
    split = tensor_map_layouts(split_spec, Problem(**{**problem().__dict__, "num_splits": 5}))
    part = split["out_map"]
    assert (part.tensor, part.data_type) == ("o_partial", "float32")
    assert part.dims == (96, 100, 4, 5 * 3) and part.box == (32, 64, 1, 1)
    assert part.strides_bytes == (4 * 96, 4 * 100 * 96, 4 * 4 * 100 * 96)
    fp8 = spec_from_dict(
        {"loop_order": "v2", "mma": "wgmma", "dtype": "float8_e4m3", "head_dim": 128}
        | {"block_m": 128, "block_n": 128, **tma}
    )
    d128 = Problem(**{**problem().__dict__, "head_dim": 128, "q_strides": (51200, 12800, 128),
                      "out_strides": (51200, 12800, 128)})  # fmt: skip
    layouts = tensor_map_layouts(fp8, d128)
    out, q = layouts["out_map"], layouts["q_map"]
    assert (out.data_type, out.box, q.data_type, q.box) == (
        "bfloat16", (64, 64, 1, 1), "uint8", (128, 128, 1, 1)
    )  # fmt: skip
    assert out.strides_bytes == (256, 100 * 256, 4 * 100 * 256)
    assert q.strides_bytes == (128, 100 * 128, 4 * 100 * 128)


def test_a_paged_cache_is_mapped_as_its_pool():
    """Paged KV: k and v span the pool (head dim, row in page, K/V head, page)."""
    spec = SPEC.model_copy(update={"paged_kv": True})
    row, page = 2 * 96, 128 * 2 * 96  # (num_pages, 128, Hkv, D) pool
    paged = Problem(
        **{**problem(kv_strides=(page, 96, row)).__dict__, "page_size": 128, "num_pages": 7}
    )
    k = tensor_map_layouts(spec, paged)["k_map"]
    assert k.dims == (96, 128, 2, 7)
    assert k.strides_bytes == (2 * row, 2 * 96, 2 * page) and k.box == (64, 64, 1, 1)


@pytest.mark.parametrize(
    ("fields", "changes", "message"),
    [
        (
            {"pack_gqa": True},
            {"num_heads": 6},
            r"= 3 is not allowed .* \(one of 1, 2, 4, 8, 16, 32, 64, 128\)",
        ),
        (
            {"paged_kv": True},
            {"page_size": 40, "num_pages": 4},
            r"^page_size=40 is not allowed .* a positive multiple of 16",
        ),
        ({"paged_kv": True}, {"page_size": 128}, r"^num_pages=0 is not allowed"),
    ],
)
def test_calls_the_decode_boxes_cannot_copy_are_input_errors(fields, changes, message):
    spec = SPEC.model_copy(update=fields)
    with pytest.raises(InputError, match=message):
        tensor_map_layouts(spec, Problem(**{**problem().__dict__, **changes}))


def test_a_stride_that_is_not_16_bytes_is_an_input_error_naming_the_tensor():
    with pytest.raises(InputError, match=r"^k: strides \(300, 60000, 120000\)"):
        tensor_map_layouts(SPEC, problem(kv_strides=(120000, 60000, 300)))
    with pytest.raises(InputError, match="not 16-byte aligned"):
        check_address(tensor_map_layouts(SPEC, problem())["q_map"], 0x1008)


def test_each_map_is_encoded_once_per_tensor_address():
    calls = []

    def encode(layout, tensor):
        calls.append((layout.tensor, device_pointer(tensor)))
        return f"map of {layout.tensor} at {device_pointer(tensor):#x}"

    cache = TensorMapCache(tensor_map_layouts(SPEC, problem()), encode)
    tensors = {"q": np.uint64(0x1000), "k": np.uint64(0x2000), "v": np.uint64(0x3000)}
    first = cache.arguments(tensors, device_pointer)
    again = cache.arguments(tensors, device_pointer)
    assert (
        first
        == again
        == {
            "q_map": "map of q at 0x1000",
            "k_map": "map of k at 0x2000",
            "v_map": "map of v at 0x3000",
        }
    )
    assert len(calls) == 3
    moved = cache.arguments({**tensors, "q": np.uint64(0x4000)}, device_pointer)
    assert moved["q_map"] == "map of q at 0x4000" and len(calls) == 4


def test_device_pointer_of_each_kind_of_argument():
    array = np.zeros(8, dtype=np.float32)
    assert device_pointer(array) == array.ctypes.data
    assert device_pointer(np.uint64(1234)) == 1234

    class CupyLike:
        class data:  # noqa: N801 (CuPy's attribute name)
            ptr = 4096

    class TorchLike:
        def data_ptr(self):
            return 8192

    assert device_pointer(CupyLike()) == 4096 and device_pointer(TorchLike()) == 8192


def test_device_encoding_passes_the_layout_to_the_driver_and_returns_a_by_value_argument(
    monkeypatch,
):
    """encode_on_device hands cuTensorMapEncodeTiled the layout (bf16, rank 4, dims, byte
    strides, box, unit element strides, no interleave, 128B swizzle, zero OOB fill) and returns
    the 128 bytes as a one-element structured array (CuPy passes size-one arrays by value)."""
    driver = pytest.importorskip("cuda.bindings.driver")
    from kernelgen.runtime.tensor_maps import TENSOR_MAP_DTYPE, encode_on_device

    seen = {}

    class FakeMap:
        opaque = tuple(range(100, 116))

    def fake_encode(*args):
        seen["args"] = args
        return driver.CUresult.CUDA_SUCCESS, FakeMap()

    monkeypatch.setattr(driver, "cuTensorMapEncodeTiled", fake_encode)
    layout = tensor_map_layouts(SPEC, problem())["k_map"]
    encoded = encode_on_device(layout, 0x7F0000001000)
    assert encoded.shape == (1,) and encoded.dtype == TENSOR_MAP_DTYPE
    assert encoded.nbytes == 128 and list(encoded["opaque"][0]) == list(range(100, 116))
    args = seen["args"]
    assert args[0] == driver.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_BFLOAT16
    assert args[1:3] == (4, 0x7F0000001000)
    # the lists hold cuda-bindings' integer types, as the real binding demands (it raises
    # TypeError on plain ints: the first H100 run of the wgmma kernels failed on exactly that)
    dims, strides, box, elem = args[3:7]
    for values, kind in ((dims, driver.cuuint64_t), (strides, driver.cuuint64_t),
                         (box, driver.cuuint32_t), (elem, driver.cuuint32_t)):  # fmt: skip
        assert all(isinstance(v, kind) for v in values), (values, kind)
    assert [[int(v) for v in x] for x in (dims, strides, box, elem)] == [
        [96, 300, 2, 3], [192, 57600, 115200], [64, 64, 1, 1], [1, 1, 1, 1]
    ]  # fmt: skip
    assert args[7] == driver.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE
    assert args[8] == driver.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B
    assert args[10] == driver.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE
    with pytest.raises(InputError, match="not 16-byte aligned"):
        encode_on_device(layout, 0x7F0000001008)


def test_the_real_binding_accepts_the_encoders_arguments():
    """The argument conversion of cuda-bindings' own cuTensorMapEncodeTiled runs before it
    loads the driver: here (no driver) the call must get past it and fail only for want of a
    driver, never with the binding's TypeError."""
    pytest.importorskip("cuda.bindings.driver")
    from kernelgen.runtime.tensor_maps import encode_on_device

    layout = tensor_map_layouts(SPEC, problem())["q_map"]
    try:
        encode_on_device(layout, 0x7F0000001000)
    except TypeError as exc:  # the binding refused an argument's type
        pytest.fail(f"cuTensorMapEncodeTiled refused the arguments: {exc}")
    except (InputError, RuntimeError):  # no driver library, or the driver has no device
        pass
