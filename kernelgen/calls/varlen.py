"""``kernelgen.attention_varlen``: packed variable-length batches (flash-attn's
``flash_attn_varlen_func``), as a host-side plan over the existing kernels.

The sequences of a batch lie end to end: q is (total_q, H, D), k and v (total_k, Hkv, D), and
``cu_seqlens_q``/``cu_seqlens_k`` (B + 1 offsets from 0) say where each one starts. The plan
reads the offsets on the host, cuts the batch into runs of consecutive sequences with equal
(query, key) lengths, and runs each run as one ``attention()`` call on views of q, k and v
(layout "bshd": a run of n sequences of Sq queries is an (n, Sq, H, D) view, no copy). Every
launch therefore covers exactly its sequences' rows and keys: no Q tile spans two sequences and
no block visits a key tile past its sequence's end (no work on padding). The price: one call per
run (a batch of all-different lengths takes B calls), a copy of each run's out (and lse) into the
packed outputs, and device-resident offsets are read back to the host (one synchronisation).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np

from kernelgen.calls.attention import TensorInfo, check_flags, check_inputs, describe
from kernelgen.calls.training import attention
from kernelgen.calls.variant_inputs import VariantArgs, check_variants
from kernelgen.errors import InputError, InputTypeError
from kernelgen.runtime.frameworks import arrays_of, device_of, module_of, refuse_during_capture
from kernelgen.specs.forward import KernelSpec

__all__ = ["attention_varlen", "sequence_runs"]


def attention_varlen(
    q: Any,
    k: Any,
    v: Any,
    cu_seqlens_q: Any,
    cu_seqlens_k: Any,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    causal: bool = False,
    scale: float | None = None,
    return_lse: bool = False,
    spec: KernelSpec | None = None,
    num_splits: int | None = None,
    window_size: tuple[int, int] | None = None,
    softcap: float | None = None,
    alibi_slopes: Any = None,
    sinks: Any = None,
) -> Any:
    """Attention over packed sequences of different lengths (flash-attn's varlen semantics).

    q is (total_q, H, D), k and v (total_k, Hkv, D) with H % Hkv == 0; ``cu_seqlens_q`` and
    ``cu_seqlens_k`` are (B + 1,) offsets (a list, a NumPy or int32 array of q's library):
    sequence b holds queries ``cu_seqlens_q[b]:cu_seqlens_q[b + 1]`` and keys
    ``cu_seqlens_k[b]:cu_seqlens_k[b + 1]``. They start at 0, never decrease and end at
    total_q / total_k; every length is at most ``max_seqlen_q`` / ``max_seqlen_k``. Device
    offsets are read back to the host (one synchronisation) and checked like host ones.
    ``causal`` is bottom-right aligned per sequence (query i of a sequence with Sq queries and
    Sk keys sees key j iff j <= i + Sk - Sq). Zero-length sequences are allowed; a sequence with
    queries but no keys gives out 0 and lse -inf. ``spec``/``num_splits`` as in ``attention()``
    (a spec serves every run; its causal flag must match). Returns out (total_q, H, D) in q's
    dtype and library, and with ``return_lse`` the fp32 LSE of shape (H, total_q).
    The variants (docs/variants.md) as in ``attention()``, per sequence (its own offset
    Sk - Sq); ``alibi_slopes`` is (H,) or (B, H) with B the number of sequences.
    """
    check_flags(causal=causal, return_lse=return_lse)
    infos = [describe(x, n) for x, n in ((q, "q"), (k, "k"), (v, "v"))]
    for t in infos:
        if len(t.shape) != 3:
            shape = "(total_q, H, D)" if t.name == "q" else "(total_k, Hkv, D)"
            raise InputError(
                f"{t.name} has rank {len(t.shape)} (shape {t.shape}); expected rank 3, {shape}"
            )
    # attention()'s checks on the metadata, the packed rows seen as one batch entry of "bshd"
    # (an empty q, k or v, which NumPy gives zero strides, is checked as one contiguous row)
    as_batch = [
        TensorInfo(
            t.name,
            (1, max(t.shape[0], 1), *t.shape[1:]),
            (0, *t.strides) if t.shape[0] else (0, t.shape[1] * t.shape[2], t.shape[2], 1),
            t.dtype,
            t.source,
        )
        for t in infos
    ]
    variants = VariantArgs(window_size, softcap, alibi_slopes, sinks)
    check_inputs(
        *as_batch,
        None,
        layout="bshd",
        scale=scale,
        spec=None if alibi_slopes is not None else spec,  # its flags: checked per run below
        causal=bool(causal),
        variants=replace(variants, alibi_slopes=None),  # one batch entry here: checked below
    )
    total_q, heads, head_dim = infos[0].shape
    total_k = infos[1].shape[0]
    if infos[2].shape[0] != total_k:
        raise InputError(
            f"k has shape {infos[1].shape} but v has {infos[2].shape}; they must match"
        )
    device = device_of(q)
    for name, x in (("k", k), ("v", v)):
        if device_of(x) != device:
            raise InputError(
                f"{name} is on device {device_of(x)} but q is on device {device} (-1: the CPU); "
                "pass q, k and v on one device"
            )
    starts_q = _offsets(cu_seqlens_q, "cu_seqlens_q", total_q, "q", device)
    starts_k = _offsets(cu_seqlens_k, "cu_seqlens_k", total_k, "k", device)
    if starts_q.shape != starts_k.shape:
        raise InputError(
            f"cu_seqlens_q has {starts_q.shape[0]} entries but cu_seqlens_k has "
            f"{starts_k.shape[0]}; both are (B + 1,), one offset per sequence plus the end"
        )
    _check_max(max_seqlen_q, "max_seqlen_q", np.diff(starts_q), "cu_seqlens_q")
    _check_max(max_seqlen_k, "max_seqlen_k", np.diff(starts_k), "cu_seqlens_k")
    per_sequence = False  # ALiBi slopes per sequence, (B, H)
    if alibi_slopes is not None:  # (H,) or (B, H), B the sequences
        slopes = check_variants(
            VariantArgs(alibi_slopes=alibi_slopes),
            describe=describe,
            causal=False,
            batch=starts_q.shape[0] - 1,
            heads=heads,
            seqlen_q=max_seqlen_q,
            seqlen_k=max_seqlen_k,
        ).alibi
        per_sequence = len(slopes.shape) == 2

    arrays = arrays_of(q)
    with arrays.scope(device):
        out = arrays.empty((total_q, heads, head_dim), arrays.dtype_of(q), device)
        lse = arrays.empty((heads, total_q), arrays.float32(), device) if return_lse else None
    for first, count, len_q, len_k in sequence_runs(starts_q, starts_k):
        q0, k0 = int(starts_q[first]), int(starts_k[first])
        rows = slice(q0, q0 + count * len_q)
        if len_k == 0:  # queries that see no key (with sinks: lse = sink)
            out[rows] = 0
            if lse is not None:
                lse[:, rows] = float("-inf") if sinks is None else sinks[:, None]
            continue
        slopes_run = alibi_slopes
        if alibi_slopes is not None and per_sequence:
            slopes_run = alibi_slopes[first : first + count]
        keys = slice(k0, k0 + count * len_k)
        result = attention(
            q[rows].reshape(count, len_q, heads, head_dim),
            k[keys].reshape(count, len_k, -1, head_dim),
            v[keys].reshape(count, len_k, -1, head_dim),
            causal=causal,
            scale=scale,
            spec=spec,
            num_splits=num_splits,
            return_lse=return_lse,
            layout="bshd",
            window_size=window_size,
            softcap=softcap,
            alibi_slopes=slopes_run,
            sinks=sinks,
        )
        run_out, run_lse = result if return_lse else (result, None)
        out[rows] = run_out.reshape(count * len_q, heads, head_dim)
        if lse is not None:  # (count, H, Sq) -> (H, count * Sq)
            lse[:, rows] = run_lse.swapaxes(0, 1).reshape(heads, count * len_q)
    return (out, lse) if return_lse else out


def sequence_runs(starts_q: np.ndarray, starts_k: np.ndarray) -> list[tuple[int, int, int, int]]:
    """The launches of a varlen batch: (first sequence, count, Sq, Sk) for each run of
    consecutive sequences with equal query and key lengths, sequences without queries left out
    (they own no rows). A run with Sk = 0 needs no kernel (its rows see no key)."""
    lengths_q, lengths_k = np.diff(starts_q), np.diff(starts_k)
    runs: list[tuple[int, int, int, int]] = []
    for b, (len_q, len_k) in enumerate(zip(lengths_q.tolist(), lengths_k.tolist(), strict=True)):
        if len_q == 0:
            continue
        if runs:
            first, count, run_q, run_k = runs[-1]
            if first + count == b and (run_q, run_k) == (len_q, len_k):
                runs[-1] = (first, count + 1, run_q, run_k)
                continue
        runs.append((b, 1, len_q, len_k))
    return runs


def _offsets(values: Any, name: str, total: int, tensor: str, device: int) -> np.ndarray:
    """``cu_seqlens_*`` as host int64 offsets, checked: 1-D with at least one entry, integers
    (int32 for arrays), starting at 0, non-decreasing, ending at ``total`` (the rows of
    ``tensor``). Device arrays must be on q's device and are read back (not while a CUDA graph
    is being captured)."""
    if isinstance(values, (list, tuple)):
        host = np.asarray(values)
        if host.size and host.dtype.kind not in "iu":
            raise InputTypeError(f"{name} holds {host.dtype} values; expected integers")
        host = host.astype(np.int64) if host.size else np.zeros((0,), np.int64)
    else:
        library = module_of(values)
        if library not in ("numpy", "cupy", "torch"):
            raise InputTypeError(
                f"{name} has type {type(values).__name__}; expected a list of ints or an int32 "
                "NumPy, CuPy or torch array"
            )
        info = describe(values, name)
        if info.dtype != "int32":
            raise InputTypeError(f"{name} has dtype {info.dtype}; expected int32")
        where = device_of(values)
        if where != device:
            raise InputError(
                f"{name} is on device {where} but q is on device {device}; pass it on q's "
                "device or as a host list"
            )
        if library == "numpy":
            host = values
        elif library == "torch":
            if where >= 0:
                refuse_during_capture(name, values, "a host list (offsets are read on the host)")
            host = values.detach().cpu().numpy()
        else:
            refuse_during_capture(name, values, "a host list (offsets are read on the host)")
            host = values.get()
        host = np.asarray(host).astype(np.int64)
    if host.ndim != 1 or host.shape[0] < 1:
        raise InputError(
            f"{name} has shape {host.shape}; expected (B + 1,): B >= 0 sequences' start offsets "
            "and the end"
        )
    if host[0] != 0:
        raise InputError(f"{name}[0] is {int(host[0])}; the offsets start at 0")
    steps = np.flatnonzero(np.diff(host) < 0)
    if steps.size:
        i = int(steps[0])
        raise InputError(
            f"{name} decreases at index {i + 1} ({int(host[i])} then {int(host[i + 1])}); "
            "offsets must be non-decreasing"
        )
    if host[-1] != total:
        raise InputError(
            f"{name}[-1] is {int(host[-1])} but {tensor} holds {total} rows; the last offset "
            f"must equal {tensor}.shape[0]"
        )
    return host


def _check_max(value: Any, name: str, lengths: np.ndarray, offsets: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise InputTypeError(f"{name} has type {type(value).__name__}; expected an int")
    if value < 0:
        raise InputError(f"{name}={value} is not allowed; use 0 or more")
    if lengths.size and lengths.max() > value:
        b = int(np.argmax(lengths))
        raise InputError(
            f"{offsets} gives sequence {b} a length of {int(lengths[b])}, more than "
            f"{name}={value}; pass at least the longest sequence's length"
        )
