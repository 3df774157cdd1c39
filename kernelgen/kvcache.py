"""``kernelgen.attention_with_kvcache``: decode against a contiguous KV cache, appending the
step's keys and values in place first (flash-attn's ``flash_attn_with_kvcache`` without
``block_table``).

The cache is (B, S_max, Hkv, D) per tensor, batch entry b holding ``cache_seqlens[b]`` valid
keys. With ``k_new``/``v_new`` (B, S_new, Hkv, D) the call copies them into rows
``cache_seqlens[b] : cache_seqlens[b] + S_new`` of the cache (slice assignments of the arrays'
own library, on the call's stream), then attends with ``attention(layout="bshd",
seqlens_k=cache_seqlens + S_new)``: the existing decode path, GQA packing and split-KV included.
Every check, the spec choice and the launch plan come before the first write, so a bad call
leaves the cache untouched.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np

from kernelgen.api import (
    check_inputs,
    check_num_splits,
    checked_plan,
    common_device,
    describe,
)
from kernelgen.errors import InputError, InputTypeError
from kernelgen.frameworks import arrays_of, device_of, module_of, refuse_during_capture
from kernelgen.spec import KernelSpec

__all__ = ["attention_with_kvcache"]

_LIBRARIES = ("numpy", "cupy", "torch")


def attention_with_kvcache(
    q: Any,
    k_cache: Any,
    v_cache: Any,
    cache_seqlens: Any,
    *,
    k_new: Any = None,
    v_new: Any = None,
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
    """Attention of q over a contiguous KV cache, after appending ``k_new``/``v_new`` in place.

    q is (B, Sq, H, D); ``k_cache``/``v_cache`` (B, S_max, Hkv, D) with H % Hkv == 0, all in
    "bshd" layout. ``cache_seqlens`` gives each batch entry's valid keys: an int (every entry),
    a list of ints, or an int32 (B,) array (NumPy, or q's library on q's device).

    With ``k_new`` and ``v_new`` (B, S_new, Hkv, D, the cache's dtype), row s of entry b is
    written to ``cache[b, cache_seqlens[b] + s]`` before attending, so q sees
    ``cache_seqlens[b] + S_new`` keys; every ``cache_seqlens[b] + S_new`` must be at most
    S_max. Device ``cache_seqlens`` are then read back to the host (one synchronisation;
    refused while a CUDA graph is being captured) and checked like host ones. Without
    ``k_new``, q sees ``cache_seqlens[b]`` keys and device lengths are not read (the kernels
    clamp them to [0, S_max]). The call does not advance ``cache_seqlens``: the caller adds
    S_new for the next step (as with flash-attn).

    ``causal`` is bottom-right aligned to each entry's updated length: query i of Sq sees key j
    iff ``j <= i + cache_seqlens[b] + S_new - Sq`` (with Sq == S_new, each new token sees the
    cache and the new tokens up to itself). ``scale``, ``spec``, ``num_splits`` and
    ``return_lse`` as in ``attention()``. Returns out (B, Sq, H, D) in q's dtype and library,
    and with ``return_lse`` the fp32 LSE of shape (B, H, Sq). Every check runs before the cache
    is written: a call that raises leaves it unchanged. The variants (``window_size``,
    ``softcap``, ``alibi_slopes``, ``sinks``; docs/variants.md) as in ``attention()``, aligned
    like ``causal`` to each entry's updated length.
    """
    infos = [describe(x, n) for x, n in ((q, "q"), (k_cache, "k_cache"), (v_cache, "v_cache"))]
    for t in infos:
        if len(t.shape) != 4:
            shape = "(B, Sq, H, D)" if t.name == "q" else "(B, S_max, Hkv, D)"
            raise InputError(
                f"{t.name} has rank {len(t.shape)} (shape {t.shape}); expected rank 4, {shape}"
            )
    q_info, k_info, v_info = infos
    if k_info.shape != v_info.shape:
        raise InputError(
            f"k_cache has shape {k_info.shape} but v_cache has {v_info.shape}; they must match"
        )
    if k_info.shape[0] != q_info.shape[0]:
        raise InputError(f"k_cache has batch {k_info.shape[0]} but q has batch {q_info.shape[0]}")
    variant_arrays = {"alibi_slopes": alibi_slopes, "sinks": sinks}
    call = check_inputs(
        *infos,
        None,
        layout="bshd",
        scale=scale,
        spec=spec,
        causal=bool(causal),
        window_size=window_size,
        softcap=softcap,
        **{n: describe(x, n) for n, x in variant_arrays.items() if x is not None},
    )
    # the kernels' parameter names (errors above named the caches)
    call = replace(call, k=replace(call.k, name="k"), v=replace(call.v, name="v"))
    num_splits = check_num_splits(num_splits, spec)
    batch, max_keys = k_info.shape[:2]
    appending = k_new is not None or v_new is not None
    new_len = _check_new(k_new, v_new, k_info) if appending else 0
    if appending:
        libraries = {n: module_of(x) for n, x in _named(q, k_cache, v_cache, k_new, v_new)}
        if (
            any(lib not in _LIBRARIES for lib in libraries.values())
            or len(set(libraries.values())) != 1
        ):
            raise InputTypeError(
                "appending needs q, k_cache, v_cache, k_new and v_new as arrays of one library "
                f"(NumPy, CuPy or torch); got {libraries}"
            )
        for name, x in (("k_cache", k_cache), ("v_cache", v_cache)):
            if isinstance(x, np.ndarray) and not x.flags.writeable:
                raise InputError(f"{name} is read-only; the call writes k_new/v_new into it")
            if getattr(x, "requires_grad", False) and getattr(x, "is_leaf", False):
                raise InputError(
                    f"{name} is a leaf tensor that requires grad; the call writes k_new/v_new "
                    "into it in place (pass a cache without requires_grad)"
                )
    host_lengths = _host_lengths(cache_seqlens, batch, q)
    device = common_device(
        {
            "q": q,
            "k_cache": k_cache,
            "v_cache": v_cache,
            "k_new": k_new,
            "v_new": v_new,
            "cache_seqlens": None if host_lengths is not None else cache_seqlens,
            **variant_arrays,
        }
    )
    arrays = arrays_of(q)
    with arrays.scope(device):
        if appending and host_lengths is None:  # device lengths: read back once
            refuse_during_capture(
                "cache_seqlens", cache_seqlens, "host lengths (a list or NumPy int32 array)"
            )
            host_lengths = _as_host(cache_seqlens)
        if host_lengths is not None:
            _check_lengths(host_lengths, new_len, max_keys)
            seqlens_k: Any = (host_lengths + new_len).astype(np.int32)
        else:
            seqlens_k = cache_seqlens
        call_plan, tensors, temporaries = checked_plan(
            call, bool(causal), seqlens_k, spec, num_splits, "bshd", arrays, device
        )
        if appending and new_len:
            _append(k_cache, k_new, host_lengths, new_len)
            _append(v_cache, v_new, host_lengths, new_len)
        out, lse = call_plan.launch_outputs(tensors, bool(return_lse))
        del temporaries  # each library frees in stream order: safe once queued
    return (out, lse) if return_lse else out


def _named(*arrays: Any) -> list[tuple[str, Any]]:
    return list(zip(("q", "k_cache", "v_cache", "k_new", "v_new"), arrays, strict=True))


def _check_new(k_new: Any, v_new: Any, cache: Any) -> int:
    """S_new, after checking k_new and v_new against the cache's (B, S_max, Hkv, D) info."""
    if k_new is None or v_new is None:
        given, missing = ("k_new", "v_new") if v_new is None else ("v_new", "k_new")
        raise InputError(f"{given} is given but {missing} is not; pass both or neither")
    batch, _, kv_heads, head_dim = cache.shape
    infos = [describe(k_new, "k_new"), describe(v_new, "v_new")]
    for t in infos:
        if len(t.shape) != 4:
            raise InputError(
                f"{t.name} has rank {len(t.shape)} (shape {t.shape}); expected rank 4, "
                "(B, S_new, Hkv, D)"
            )
        if (t.shape[0], t.shape[2], t.shape[3]) != (batch, kv_heads, head_dim):
            raise InputError(
                f"{t.name} has shape {t.shape}; expected (B, S_new, Hkv, D) = ({batch}, S_new, "
                f"{kv_heads}, {head_dim}), the cache's batch, heads and head_dim"
            )
        if t.dtype != cache.dtype:
            raise InputTypeError(
                f"{t.name} has dtype {t.dtype} but the cache has {cache.dtype}; they must match"
            )
    if infos[0].shape != infos[1].shape:
        raise InputError(
            f"k_new has shape {infos[0].shape} but v_new has {infos[1].shape}; they must match"
        )
    return int(infos[0].shape[1])


def _host_lengths(values: Any, batch: int, q: Any) -> np.ndarray | None:
    """``cache_seqlens`` as host int64 lengths (shape and type checked), or None for an int32
    device array of q's library (checked here, read later only if needed)."""
    if isinstance(values, (int, np.integer)) and not isinstance(values, bool):
        return np.full((batch,), int(values), np.int64)
    if isinstance(values, (list, tuple)):
        host = np.asarray(values)
        if host.size and host.dtype.kind not in "iu":
            raise InputTypeError(f"cache_seqlens holds {host.dtype} values; expected integers")
        host = host.astype(np.int64)
        if host.shape != (batch,):
            raise InputError(
                f"cache_seqlens has shape {host.shape}; expected ({batch},), one length per "
                "batch entry"
            )
        return host
    library = module_of(values)
    if library not in _LIBRARIES:
        raise InputTypeError(
            f"cache_seqlens has type {type(values).__name__}; expected an int, a list of ints "
            "or an int32 NumPy, CuPy or torch array"
        )
    info = describe(values, "cache_seqlens")
    if info.dtype != "int32":
        raise InputTypeError(f"cache_seqlens has dtype {info.dtype}; expected int32")
    if info.shape != (batch,):
        raise InputError(
            f"cache_seqlens has shape {info.shape}; expected ({batch},), one length per batch entry"
        )
    if device_of(values) < 0:
        return _as_host(values)
    if library != module_of(q):
        raise InputTypeError(
            f"cache_seqlens is a {library} array but q is a {module_of(q)} one; pass it in q's "
            "library or on the host"
        )
    if info.strides != (1,):
        raise InputError(f"cache_seqlens has stride {info.strides[0]}; expected a contiguous array")
    return None


def _as_host(values: Any) -> np.ndarray:
    library = module_of(values)
    if library == "torch":
        values = values.detach().cpu().numpy()
    elif library == "cupy":
        values = values.get()
    return np.asarray(values).astype(np.int64)


def _check_lengths(lengths: np.ndarray, new_len: int, max_keys: int) -> None:
    """0 <= cache_seqlens[b] and cache_seqlens[b] + S_new <= S_max, naming the first bad b."""
    bad = np.flatnonzero((lengths < 0) | (lengths + new_len > max_keys))
    if bad.size:
        b = int(bad[0])
        length = int(lengths[b])
        if length < 0:
            raise InputError(f"cache_seqlens[{b}] is {length}; lengths are 0 or more")
        raise InputError(
            f"cache_seqlens[{b}] is {length} and S_new is {new_len}: {length + new_len} keys do "
            f"not fit the cache's S_max = {max_keys} rows"
        )


def _append(cache: Any, new: Any, lengths: np.ndarray, new_len: int) -> None:
    """cache[b, lengths[b] : lengths[b] + new_len] = new[b] for every b (one slice assignment
    when all lengths are equal), in the arrays' own library and stream."""
    if lengths.size and (lengths == lengths[0]).all():
        start = int(lengths[0])
        cache[:, start : start + new_len] = new
        return
    for b, start in enumerate(lengths.tolist()):
        cache[b, start : start + new_len] = new[b]
