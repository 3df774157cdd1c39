"""TMA tensor maps of the wgmma (sm_90a) kernels: what to encode, and the encoders.

A wgmma kernel reads q, k and v through tensor maps (``const __grid_constant__ CUtensorMap``
parameters) instead of pointers. Each map describes one tensor as 4-d, innermost first: (head
dim, sequence, head, batch), with the tensor's own byte strides, so batch, head and GQA are
coordinates of the copy and any strided (B, H, S, D) or (B, S, H, D) view works as long as the
driver's rules hold (16-byte aligned base, strides multiples of 16 bytes). The box is one
64-column (128-byte) block of block_m query rows or block_n key rows, 128-byte swizzled (fp8 at
d64: 64-byte rows, 64-byte swizzled; fp8's V^T: rows of block_n keys, swizzled by their span); rows
past the sequence and columns past the head dim read as zeros. Packed GQA (q) and a paged
cache (k, v) change the maps' shapes, not the kernels' copies: :func:`tensor_map_layouts`.
With ``epilogue: tma`` the kernel also writes out through a map (``out_map``, 64-row boxes;
5-d like q's with packed GQA).

Everything but the data pointer follows from the spec and the call shape, so a call plan
computes its :class:`TensorMapLayout` once; encoding is per pointer (on a GPU the driver's
``cuTensorMapEncodeTiled`` from cuda-bindings, imported lazily; on the CPU the emulator's
``encode_tensor_map_tiled``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from kernelgen.errors import InputError, ToolchainMissingError
from kernelgen.specs.forward import (
    DTYPE_BYTES,
    WGMMA_ROW_BYTES,
    WGMMA_ROWS_PER_WARPGROUP,
    KernelSpec,
)

TMA_ALIGN_BYTES = 16  # the base address and every stride of a tensor map
# A box row's bytes -> the swizzle the kernels' wgmma descriptors read it with: each box row is
# one swizzle span (Q and K rows of 128 bytes, or 64 for fp8 at d64; fp8's V^T rows are block_n
# keys).
SWIZZLE_OF_ROW_BYTES = {128: "128B", 64: "64B"}
L2_PROMOTION = "256B"  # K and V rows are read by every row tile of a head: promote whole lines
# A spec's dtype -> the tensor map's data type (fp8 travels as bytes: TMA does not convert).
TMA_DATA_TYPE = {
    "float16": "float16",
    "bfloat16": "bfloat16",
    "float8_e4m3": "uint8",
    "float32": "float32",  # split-KV's partials (the TMA-store epilogue)
}
# fp8's V operand is V^T (batch, kv head, head dim, keys rounded up to FP8_KEY_GROUP), its keys
# permuted within each group (kernelgen.runtime.fp8.v_operand); its box is head-dim rows of block_n
# keys.
FP8_KEY_GROUP = 16
# The kernel parameter of each map -> the tensor it maps, and which tile rows its box holds.
MAP_TENSORS = {"q_map": ("q", "block_m"), "k_map": ("k", "block_n"), "v_map": ("v", "block_n")}
# epilogue: tma (docs/hopper.md): out_map, whose box is one consumer warpgroup's 64 rows of one
# column block (each consumer stores its own rows). Its sequence extent is the call's seqlen_q,
# so a TMA store clips the rows of a last tile past the queries.
OUT_MAP = ("out_map", "out", WGMMA_ROWS_PER_WARPGROUP)
# With split-KV, out_map maps the fp32 partial outputs (the launch's scratch buffer of this name)
# as (head dim, query, head, split * batch + b): a chunk's partials start batch entries on.
PARTIAL_TENSOR = "o_partial"


@dataclass(frozen=True)
class TensorMapLayout:
    """The encode parameters of one tensor map except the address, innermost dimension first."""

    tensor: str  # q, k, v or out (for messages)
    data_type: str  # float16, bfloat16 or uint8 (fp8)
    dims: tuple[int, ...]  # (head_dim, seq, heads, batch); packed GQA's q: 5-d (below)
    strides_bytes: tuple[int, ...]  # of dims 1.. (bytes)
    box: tuple[int, ...]  # (64, tile rows, 1, 1)
    swizzle: str = "128B"  # SWIZZLE_OF_ROW_BYTES: the span of one box row

    @property
    def element_strides(self) -> tuple[int, ...]:
        return (1,) * len(self.dims)


def _checked_strides(tensor: str, strides_elems: tuple[int, ...], elem: int) -> tuple[int, ...]:
    """Byte strides of ``tensor``; InputError naming it when one breaks TMA's 16-byte rule."""
    strides = tuple(s * elem for s in strides_elems)
    if any(s % TMA_ALIGN_BYTES or s <= 0 for s in strides):
        raise InputError(
            f"{tensor}: strides {strides_elems} (sequence, head, batch; elements) are not "
            f"allowed with mma='wgmma'; the tensor copies (TMA) need positive strides that are "
            f"multiples of {TMA_ALIGN_BYTES // elem} elements (a contiguous copy of the tensor "
            "has them)"
        )
    return strides


# The wgmma kernel's cp.async copies of pages that are no multiple of block_n step 16 rows at a
# time through a page (templates/wgmma_paged_kv.cuh.j2: ROW_STEP), as the public API's pages are.
PAGE_ROWS = 16


def check_wgmma_decode(spec: KernelSpec, problem: Any) -> None:
    """What a wgmma spec's TMA boxes need of the call (InputError naming the value and what is
    allowed): packed GQA, a group (H/Hkv) that divides block_m (a box holds whole queries);
    a paged cache, a positive page size and page count (pages of any size: the kernel copies
    a key tile by TMA when it lies in one page, else row by row with cp.async)."""
    if spec.pack_gqa and spec.block_m % problem.group:
        allowed = ", ".join(str(g) for g in range(1, spec.block_m + 1) if spec.block_m % g == 0)
        raise InputError(
            f"num_heads / num_kv_heads = {problem.num_heads} / {problem.num_kv_heads} = "
            f"{problem.group} is not allowed with spec {spec.uri} (mma='wgmma', pack_gqa, "
            f"block_m={spec.block_m}): one TMA box packs whole queries, so the group must divide "
            f"block_m (one of {allowed}); use an mma_sync spec"
        )
    if spec.paged_kv and (problem.page_size <= 0 or problem.page_size % PAGE_ROWS):
        raise InputError(
            f"page_size={problem.page_size} is not allowed with spec {spec.uri} (mma='wgmma', "
            f"paged_kv): a positive multiple of {PAGE_ROWS} (a multiple of block_n="
            f"{spec.block_n} is copied by TMA, others row by row with cp.async, {PAGE_ROWS} "
            "rows per step)"
        )
    if spec.paged_kv and problem.num_pages <= 0:
        raise InputError(
            f"num_pages={problem.num_pages} is not allowed with spec {spec.uri} (mma='wgmma', "
            "paged_kv): its tensor maps span the page pool; pass the pool's page count"
        )


def tensor_map_layouts(spec: KernelSpec, problem: Any) -> dict[str, TensorMapLayout]:
    """The layouts of q_map, k_map and v_map (and out_map with ``epilogue: tma``) for one call
    shape (a :class:`kernelgen.runtime.launch.Problem`, which imports this module); raises
    :class:`InputError` naming the tensor when a stride breaks TMA's 16-byte rule, or the value
    when the call does not fit the spec's boxes (:func:`check_wgmma_decode`).

    Packed GQA: q (and out) are 5-d, (head dim, head in the group, query, K/V head, batch), and
    the box (64, group, rows / group, 1, 1) lands rows in the packed order query * group + head;
    out's 64-row box takes (64, 64, 1, 1, 1) when the group is 128 (half of one query's heads).
    Paged KV: k and v span the pool, (head dim, row in page, K/V head, page)."""
    check_wgmma_decode(spec, problem)
    seqlen_k, kv_batch = problem.seqlen_k, problem.batch
    if spec.paged_kv:  # the (b, h, s) strides are (page, head, row)
        seqlen_k, kv_batch = problem.page_size, problem.num_pages
    shapes = {
        "q": (problem.seqlen_q, problem.num_heads, problem.batch, problem.q_strides),
        "k": (seqlen_k, problem.num_kv_heads, kv_batch, problem.k_strides),
        "v": (seqlen_k, problem.num_kv_heads, kv_batch, problem.v_strides),
    }
    maps = {param: (tensor, getattr(spec, field)) for param, (tensor, field) in MAP_TENSORS.items()}
    if spec.epilogue == "tma":
        param, tensor, rows = OUT_MAP
        if spec.split_kv:  # the fp32 partials (split, B, H, Sq, D): (split, B) is one dimension
            tensor = PARTIAL_TENSOR
            sq, d = problem.seqlen_q, spec.head_dim
            strides_elems = (problem.num_heads * sq * d, sq * d, d)
            outer = problem.num_splits * problem.batch
            shapes[tensor] = (sq, problem.num_heads, outer, strides_elems)
        else:
            shapes[tensor] = (
                problem.seqlen_q, problem.num_heads, problem.batch, problem.out_strides
            )  # fmt: skip
        maps[param] = (tensor, rows)
    layouts = {}
    for param, (tensor, rows) in maps.items():
        data_type = {"out": spec.out_dtype, PARTIAL_TENSOR: "float32"}.get(tensor, spec.dtype)
        elem = DTYPE_BYTES[data_type]
        seq, heads, batch, (stride_b, stride_h, stride_s) = shapes[tensor]
        strides = _checked_strides(tensor, (stride_s, stride_h, stride_b), elem)
        dims: tuple[int, ...] = (spec.head_dim, seq, heads, batch)
        if tensor in ("k", "v"):  # with clusters, each block copies a slice of the tile
            rows //= spec.cluster_m
        # (fp8 with V transposed in the kernel: v is copied as K is, into the staging ring)
        natural_v = tensor == "v" and spec.v_transposed_in_kernel
        row_bytes = spec.qk_row_bytes if tensor in ("q", "k") or natural_v else WGMMA_ROW_BYTES
        box: tuple[int, ...] = (row_bytes // elem, rows, 1, 1)  # one column block
        if tensor not in ("k", "v") and spec.pack_gqa:  # q, out or o_partial
            group = problem.group
            dims = (spec.head_dim, group, seq, problem.num_kv_heads, batch)
            strides = (strides[1], strides[0], group * strides[1], strides[2])
            box = (box[0], min(group, rows), max(rows // group, 1), 1, 1)
        if spec.fp8 and tensor == "v" and not natural_v:
            # V^T: rows of keys, strides (head dim, head, batch)
            dims = (-(-seq // FP8_KEY_GROUP) * FP8_KEY_GROUP, spec.head_dim, heads, batch)
            box = (spec.block_n, spec.head_dim, 1, 1)
            row_bytes = spec.v_row_bytes
        layouts[param] = TensorMapLayout(
            tensor=tensor,
            data_type=TMA_DATA_TYPE[data_type],
            dims=dims,
            strides_bytes=strides,
            box=box,
            swizzle=SWIZZLE_OF_ROW_BYTES[row_bytes],
        )
    return layouts


def check_address(layout: TensorMapLayout, address: int) -> None:
    """The base of a mapped tensor must be 16-byte aligned (InputError naming the tensor)."""
    if address % TMA_ALIGN_BYTES:
        raise InputError(
            f"{layout.tensor}: its data starts at an address that is not {TMA_ALIGN_BYTES}-byte "
            "aligned, which tensor copies (TMA, mma='wgmma') need; pass a contiguous copy"
        )


# An encoder turns (layout, the tensor: a device pointer or a host array) into the argument of
# a CUtensorMap parameter.
Encoder = Callable[[TensorMapLayout, Any], Any]


def encode_on_device(layout: TensorMapLayout, pointer: int) -> np.ndarray:
    """The driver's map (cuda-bindings' ``cuTensorMapEncodeTiled``) as a one-element structured
    NumPy array of 128 bytes: CuPy passes a NumPy array of size one to a kernel by value (the
    launch copies the parameter's size from it), which is how a C struct argument travels."""
    try:
        from cuda.bindings import driver
    except ImportError as exc:
        raise ToolchainMissingError(
            "cuda-bindings is not installed; mma='wgmma' builds its TMA tensor maps with the "
            "driver API (install kernelgen[cuda])"
        ) from exc
    check_address(layout, pointer)
    data_type = {
        "float16": driver.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
        "bfloat16": driver.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
        "uint8": driver.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_UINT8,
        "float32": driver.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_FLOAT32,
    }[layout.data_type]
    # The list arguments take cuda-bindings' own integer types: plain ints raise TypeError
    # ("Cannot convert int to cuuint32_t", cuda-bindings 13).
    u32, u64 = driver.cuuint32_t, driver.cuuint64_t
    err, tensor_map = driver.cuTensorMapEncodeTiled(
        data_type,
        len(layout.dims),
        pointer,
        [u64(d) for d in layout.dims],
        [u64(s) for s in layout.strides_bytes],
        [u32(b) for b in layout.box],
        [u32(e) for e in layout.element_strides],
        driver.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE,
        getattr(driver.CUtensorMapSwizzle, f"CU_TENSOR_MAP_SWIZZLE_{layout.swizzle}"),
        driver.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
        driver.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
    )
    if err != driver.CUresult.CUDA_SUCCESS:
        raise InputError(f"{layout.tensor}: the driver refused its tensor map ({err}): {layout}")
    words = np.array([int(w) for w in tensor_map.opaque], dtype=np.uint64)
    return words.view(TENSOR_MAP_DTYPE)  # shape (1,)


# The C struct CUtensorMap: 16 64-bit words.
TENSOR_MAP_DTYPE = np.dtype([("opaque", "<u8", (16,))])


def encode_on_host(layout: TensorMapLayout, array: np.ndarray) -> Any:
    """The CPU emulator's map of a host array (its ``encode_tensor_map_tiled``, same
    parameters as the driver's)."""
    from kernelgen.emulator.tensor_map import encode_tensor_map_tiled

    check_address(layout, array.ctypes.data)
    return encode_tensor_map_tiled(
        layout.data_type,
        len(layout.dims),
        array,
        layout.dims,
        layout.strides_bytes,
        layout.box,
        layout.element_strides,
        interleave="none",
        swizzle=layout.swizzle,
        l2_promotion=L2_PROMOTION,
        oob_fill="none",
    )


def device_pointer(tensor: Any) -> int:
    """The address of a launch argument: a CuPy array, a torch tensor, a pointer (``np.uint64``,
    as the launch path passes torch tensors) or a host NumPy array."""
    if isinstance(tensor, (int, np.integer)):
        return int(tensor)
    if isinstance(tensor, np.ndarray):  # the CPU backend's host arrays
        return int(tensor.ctypes.data)
    data = getattr(tensor, "data", None)
    if data is not None and hasattr(data, "ptr"):
        return int(data.ptr)
    return int(tensor.data_ptr())


def encode_device_tensor(layout: TensorMapLayout, tensor: Any) -> np.ndarray:
    """:func:`encode_on_device` of a CuPy array, torch tensor or device pointer."""
    return encode_on_device(layout, device_pointer(tensor))


def tensor_map_arguments(
    layouts: dict[str, TensorMapLayout], tensors: dict[str, Any], encode: Encoder
) -> dict[str, Any]:
    """The q_map, k_map, v_map (and out_map) arguments of a launch over ``tensors`` (by name)."""
    return {param: encode(layout, tensors[layout.tensor]) for param, layout in layouts.items()}


MAX_CACHED_MAPS = 64  # maps a call plan keeps, by tensor address (then it starts over)


class TensorMapCache:
    """The tensor maps of one call plan: the layouts computed once, each map encoded once per
    tensor address (a repeated call on the same buffers encodes nothing)."""

    def __init__(self, layouts: dict[str, TensorMapLayout], encode: Encoder) -> None:
        self.layouts = layouts
        self.encode = encode
        self._maps: dict[tuple[str, int], Any] = {}

    def arguments(self, tensors: dict[str, Any], address: Callable[[Any], int]) -> dict[str, Any]:
        """The map arguments over ``tensors``; ``address`` gives a tensor's cache key."""
        out = {}
        for param, layout in self.layouts.items():
            tensor = tensors[layout.tensor]
            key = (param, address(tensor))
            found = self._maps.get(key)
            if found is None:
                if len(self._maps) >= MAX_CACHED_MAPS:
                    self._maps.clear()
                found = self._maps[key] = self.encode(layout, tensor)
            out[param] = found
        return out
