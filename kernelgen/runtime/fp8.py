"""fp8 (e4m3) inputs of the wgmma forward: the V operand's layout and exact decoding.

Both operands of an fp8 wgmma must be K-major. For S = Q K^T they are (q and k rows run over
the head dim); for O += P V the B operand must run over keys, so the kernel reads V^T. The
caller's V (batch, kv head, keys, head dim) becomes, on the host, a copy of shape (batch,
kv head, head dim, keys rounded up to 16) whose keys are also permuted within each group of 16
(:data:`KEY_ORDER`), to match the order in which a lane's weights fill the k32 register A
fragment of P (templates/fa_fwd_wgmma.cu.j2, pack_weights): one extra read and write of V per
call, and no exchange of weights between lanes in the kernel. docs/hopper.md, "fp8".
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kernelgen.errors import InputError, InputTypeError
from kernelgen.runtime.array_ops import ArrayOps
from kernelgen.runtime.frameworks import dtype_name
from kernelgen.runtime.launch import Problem
from kernelgen.runtime.tensor_maps import FP8_KEY_GROUP

# Slot l of each 16-key group of V^T holds key KEY_ORDER[l] of the group: lane quad position q
# fills slots 4 q .. 4 q + 3 of its A register with its score columns 2 q, 2 q + 1, 8 + 2 q and
# 9 + 2 q (the accumulator layout's columns of the lane in two n8 groups).
KEY_ORDER = np.array(
    [2 * (slot // 4) + slot % 2 + 8 * (slot % 4 // 2) for slot in range(FP8_KEY_GROUP)]
)


def key_permutation(keys: int) -> np.ndarray:
    """Source key of each slot of a V^T row of ``keys`` (a multiple of 16) keys."""
    if keys % FP8_KEY_GROUP:
        raise InputError(f"keys={keys} is not allowed; use a multiple of {FP8_KEY_GROUP}")
    groups = np.arange(0, keys, FP8_KEY_GROUP)[:, None]
    return (groups + KEY_ORDER[None, :]).reshape(-1)


def slot_of_key(keys: int) -> np.ndarray:
    """The V^T slot of each key of a row of ``keys`` (a multiple of 16): the inverse of
    :func:`key_permutation`."""
    slots = np.empty(keys, np.int64)
    slots[key_permutation(keys)] = np.arange(keys)
    return slots


def v_operand_layout(
    batch: int, kv_heads: int, keys: int, head_dim: int
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(shape, element strides) of the V^T operand of v (batch, kv_heads, keys, head_dim):
    (B, Hkv, D, keys rounded up to 16), contiguous."""
    padded = -(-keys // FP8_KEY_GROUP) * FP8_KEY_GROUP
    shape = (batch, kv_heads, head_dim, padded)
    return shape, (kv_heads * head_dim * padded, head_dim * padded, padded, 1)


def v_operand(v: Any, seqlens_k: Any = None) -> Any:
    """The V^T copy an fp8 kernel reads: v (B, Hkv, Sk, D) of bytes (e4m3 bit patterns as
    uint8; any strides) -> (B, Hkv, D, Sk rounded up to 16), keys permuted by
    :func:`key_permutation`, zeros past Sk, contiguous, in v's library (NumPy, CuPy or torch)
    and on its device: one read of v and one scattered write of the copy. ``seqlens_k``
    ((B,) integers, host or of v's library and device; None: Sk): entry b's keys from
    ``seqlens_k[b]`` on are zeroed too (one more pass over the copy), since a cache's rows past
    an entry's length may hold anything, NaN included, and the kernel's zero weights would not
    hide them (0 * NaN = NaN); lengths outside [0, Sk] act as the kernels' clamp to it."""
    if len(v.shape) != 4 or dtype_name(v.dtype) != "uint8":
        raise InputError(
            f"v has shape {tuple(v.shape)} and dtype {dtype_name(v.dtype)}; expected "
            "(B, Hkv, Sk, D) of uint8 (e4m3 bit patterns)"
        )
    keys = v.shape[2]
    shape, _ = v_operand_layout(*v.shape)
    padded = shape[3]
    ops = ArrayOps(v)
    v_t = ops.empty(shape, "uint8")
    rows = v_t.swapaxes(2, 3)  # (B, Hkv, padded keys, D): a view whose writes land in v_t
    slots = slot_of_key(padded)
    rows[:, :, ops.index(slots[:keys])] = v
    if padded > keys:  # the padding keys: zero weights meet zero values
        rows[:, :, ops.index(slots[keys:])] = 0
    if seqlens_k is not None:  # bytes times 0 or 1: NaN patterns past a length become +0
        slot_keys = ops.index(key_permutation(padded))  # the key each slot holds
        lengths = ops.int64(seqlens_k)  # in v's library, on its device (host lengths too)
        kept = slot_keys[None, :] < lengths[:, None]  # (B, padded): a key of its entry
        v_t *= kept[:, None, None, :]
    return v_t


DESCALES = ("q_descale", "k_descale", "v_descale")


# Descale dtypes accepted (converted to float32, the kernels' type).
DESCALE_DTYPES = ("float32", "float16", "bfloat16", "float64")


def check_descales(
    descales: dict[str, Any], batch: int, kv_heads: int, fp8: bool
) -> dict[str, Any]:
    """The given descales (name -> array or None) as contiguous float32 (batch, kv heads)
    arrays of their own library (NumPy, CuPy or torch; anything else through NumPy); raises
    :class:`InputTypeError` for descales with non-fp8 inputs or a non-floating dtype,
    :class:`InputError` for a wrong shape."""
    given = {name: x for name, x in descales.items() if x is not None}
    for name in given:
        if name not in DESCALES:
            raise InputError(f"{name} is not allowed; the descales are {', '.join(DESCALES)}")
        if not fp8:
            raise InputTypeError(
                f"{name} is not allowed with non-fp8 inputs; descales apply to float8_e4m3 "
                "q, k and v only (leave it out)"
            )
    checked = {}
    for name, x in given.items():
        if not (hasattr(x, "shape") and hasattr(x, "dtype")):
            x = np.asarray(x)
        dtype = dtype_name(x.dtype)
        if dtype not in DESCALE_DTYPES:
            raise InputTypeError(f"{name} has dtype {dtype}; expected float32 (B, Hkv)")
        if tuple(x.shape) != (batch, kv_heads):
            raise InputError(
                f"{name} has shape {tuple(x.shape)}; expected ({batch}, {kv_heads}): one factor "
                "per (batch, kv head)"
            )
        checked[name] = ArrayOps(x).float32_contiguous(x)
    return checked


def _e4m3_table() -> np.ndarray:
    """The value of each e4m3 bit pattern (OCP FP8 E4M3: bias 7, no infinities, S.1111.111 NaN)."""
    bits = np.arange(256)
    sign = np.where(bits & 0x80, -1.0, 1.0)
    exponent, mantissa = (bits >> 3) & 0xF, bits & 0x7
    normal = (1 + mantissa / 8) * np.exp2(exponent - 7.0)
    subnormal = mantissa / 8 * 2.0**-6
    values = sign * np.where(exponent == 0, subnormal, normal)
    values[(bits & 0x7F) == 0x7F] = np.nan
    return values


E4M3_VALUES = _e4m3_table()


def decode_e4m3(bits: np.ndarray) -> np.ndarray:
    """e4m3 bit patterns (uint8) as their exact float64 values."""
    return E4M3_VALUES[np.asarray(bits, dtype=np.uint8)]


def launch_problem(q: np.ndarray, k: np.ndarray, v_t: np.ndarray) -> Problem:
    """The launch Problem of an fp8 call: q (B, H, Sq, D), k (B, Hkv, Sk, D) and the V^T
    operand ``v_t`` (:func:`v_operand`), contiguous 1-byte arrays (their byte strides are
    element strides; v's are (batch, head, head dim)), out (B, H, Sq, D) contiguous."""
    batch, heads, seqlen_q, dim = q.shape
    return Problem(
        batch=batch,
        num_heads=heads,
        num_kv_heads=k.shape[1],
        seqlen_q=seqlen_q,
        seqlen_k=k.shape[2],
        head_dim=dim,
        q_strides=q.strides[:3],  # type: ignore[arg-type]
        k_strides=k.strides[:3],  # type: ignore[arg-type]
        v_strides=v_t.strides[:3],  # type: ignore[arg-type]
        out_strides=(heads * seqlen_q * dim, seqlen_q * dim, dim),
    )
