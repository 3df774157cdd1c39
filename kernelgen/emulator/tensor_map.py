"""Host-side tensor maps for the emulated TMA: the CPU counterpart of ``cuTensorMapEncodeTiled``.

:func:`encode_tensor_map_tiled` takes the driver call's parameters, in its order, checks them by
the driver's rules and packs them into a :class:`TensorMap`: 128 bytes in the emulator's own
format (``kg_tma.h``'s ``TensorMapBlob``), passed to a kernel's ``CUtensorMap`` parameter.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kernelgen.errors import EmulatorArgumentError

__all__ = ["TENSOR_MAP_BYTES", "TensorMap", "encode_tensor_map_tiled"]

TENSOR_MAP_BYTES = 128
TENSOR_MAP_MAGIC = 0x4D54474B  # "KGTM", little endian
# magic, elem bytes, rank, swizzle code, oob fill, dtype code, interleave, l2, 5 pad bytes,
# address, 5 dims, 4 strides, 5 box dims, 5 element strides; zero padded to 128 bytes.
_LAYOUT = struct.Struct("<IBBBBBBB5xQ5Q4Q5H5B")

# tensorDataType -> (code, element bytes, NaN fill bits or None for integer types)
DATA_TYPES: dict[str, tuple[int, int, int | None]] = {
    "uint8": (0, 1, None),
    "uint16": (1, 2, None),
    "uint32": (2, 4, None),
    "int32": (3, 4, None),
    "uint64": (4, 8, None),
    "int64": (5, 8, None),
    "float16": (6, 2, 0x7FFF),
    "float32": (7, 4, 0x7FFFFFFF),
    "float64": (8, 8, 0x7FFFFFFFFFFFFFFF),
    "bfloat16": (9, 2, 0x7FFF),
}
# Driver enum values accepted beside the names (CUtensorMapSwizzle etc.).
SWIZZLES = {"none": 0, "32B": 1, "64B": 2, "128B": 3}
SWIZZLE_BYTES = {0: 0, 1: 32, 2: 64, 3: 128}
INTERLEAVES = {"none": 0}
L2_PROMOTIONS = {"none": 0, "64B": 1, "128B": 2, "256B": 3}
OOB_FILLS = {"none": 0, "nan": 1}


@dataclass(frozen=True)
class TensorMap:
    """An encoded tensor map: pass it as the argument of a ``CUtensorMap`` kernel parameter."""

    blob: bytes  # TENSOR_MAP_BYTES bytes, the emulator's format
    array: Any = None  # the global array, kept alive while the map exists

    def __post_init__(self) -> None:
        if len(self.blob) != TENSOR_MAP_BYTES:
            raise EmulatorArgumentError(f"a tensor map has {TENSOR_MAP_BYTES} bytes")


def _bad(name: str, value: Any, allowed: str) -> EmulatorArgumentError:
    return EmulatorArgumentError(f"encode_tensor_map_tiled: {name}={value!r}; allowed: {allowed}")


def _enum(name: str, value: str | int, table: dict[str, int]) -> int:
    if isinstance(value, str) and value in table:
        return table[value]
    is_int = isinstance(value, (int, np.integer)) and not isinstance(value, bool)
    if is_int and int(value) in table.values():
        return int(value)
    raise _bad(name, value, f"{', '.join(table)} (or the driver's values {sorted(table.values())})")


def _data_type(value: Any) -> str:
    if isinstance(value, str) and value in DATA_TYPES:
        return value
    try:
        name = np.dtype(value).name
    except TypeError:
        name = ""
    if name in DATA_TYPES:
        return name
    raise _bad("tensorDataType", value, ", ".join(DATA_TYPES))


def _ints(name: str, values: Sequence[int], count: int) -> list[int]:
    out = list(values) if not isinstance(values, (int, np.integer)) else [values]
    if len(out) != count or not all(
        isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in out
    ):
        raise _bad(name, values, f"{count} integers")
    return [int(v) for v in out]


def encode_tensor_map_tiled(
    tensor_data_type: Any,
    tensor_rank: int,
    global_address: np.ndarray | int,
    global_dim: Sequence[int],
    global_strides: Sequence[int],
    box_dim: Sequence[int],
    element_strides: Sequence[int],
    interleave: str | int = "none",
    swizzle: str | int = "none",
    l2_promotion: str | int = "none",
    oob_fill: str | int = "none",
) -> TensorMap:
    """A tiled tensor map from ``cuTensorMapEncodeTiled``'s parameters (dims innermost first,
    ``global_strides`` in bytes for dims 1..rank-1); raises
    :class:`~kernelgen.errors.EmulatorArgumentError` naming a parameter that breaks its rules."""
    dtype = _data_type(tensor_data_type)
    code, elem_bytes, _ = DATA_TYPES[dtype]
    if not isinstance(tensor_rank, (int, np.integer)) or not 1 <= int(tensor_rank) <= 5:
        raise _bad("tensorRank", tensor_rank, "1 to 5")
    rank = int(tensor_rank)
    array = None
    if isinstance(global_address, np.ndarray):
        array, address = global_address, int(global_address.ctypes.data)
    elif isinstance(global_address, (int, np.integer)) and not isinstance(global_address, bool):
        address = int(global_address)
    else:
        raise _bad("globalAddress", type(global_address).__name__, "a NumPy array or an address")
    if address % 16:
        raise _bad("globalAddress", hex(address), "a multiple of 16")
    dims = _ints("globalDim", global_dim, rank)
    if any(not 1 <= d <= 2**32 for d in dims):
        raise _bad("globalDim", tuple(dims), "each in [1, 2^32]")
    strides = _ints("globalStrides", global_strides, rank - 1)
    if any(s % 16 or not 0 < s < 2**40 for s in strides):
        raise _bad("globalStrides", tuple(strides), "multiples of 16 in (0, 2^40)")
    box = _ints("boxDim", box_dim, rank)
    if any(not 1 <= b <= 256 for b in box):
        raise _bad("boxDim", tuple(box), "each in [1, 256]")
    estrides = _ints("elementStrides", element_strides, rank)
    if any(not 1 <= e <= 8 for e in estrides):
        raise _bad("elementStrides", tuple(estrides), "each in [1, 8]")
    inter = _enum("interleave", interleave, INTERLEAVES)
    swz = _enum("swizzle", swizzle, SWIZZLES)
    l2 = _enum("l2Promotion", l2_promotion, L2_PROMOTIONS)
    oob = _enum("oobFill", oob_fill, OOB_FILLS)
    inner_bytes = box[0] * elem_bytes
    if inner_bytes % 16:
        raise _bad("boxDim", tuple(box), "boxDim[0] * element size a multiple of 16 bytes")
    if swz and inner_bytes > SWIZZLE_BYTES[swz]:
        raise _bad(
            "boxDim",
            tuple(box),
            f"boxDim[0] * element size at most the swizzle span {SWIZZLE_BYTES[swz]} bytes",
        )
    if oob and DATA_TYPES[dtype][2] is None:
        raise _bad("oobFill", oob_fill, "'none' for integer data types")
    pad = [0] * (5 - rank)
    blob = _LAYOUT.pack(
        TENSOR_MAP_MAGIC,
        elem_bytes,
        rank,
        swz,
        oob,
        code,
        inter,
        l2,
        address,
        *(dims + pad),
        *(strides + [0] * (4 - len(strides))),
        *(box + pad),
        *(estrides + pad),
    )
    return TensorMap(blob.ljust(TENSOR_MAP_BYTES, b"\0"), array)
