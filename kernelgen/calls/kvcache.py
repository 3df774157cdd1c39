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

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import numpy as np

from kernelgen.calls.attention import (
    Paging,
    TensorInfo,
    check_expression_libraries,
    check_flags,
    check_inputs,
    check_num_splits,
    checked_plan,
    common_device,
    describe,
)
from kernelgen.calls.fp8 import wants_fp8
from kernelgen.calls.kvcache_checks import (
    check_lengths,
    check_pages,
    paged_slots,
)
from kernelgen.calls.kvcache_fp8 import fp8_attention_with_kvcache
from kernelgen.calls.kvcache_inputs import (
    LIBRARIES,
    append_paged_rows,
    append_rows,
    as_batched,
    cache_lengths,
    check_new,
    paged_layout,
    read_metadata,
)
from kernelgen.calls.variant_inputs import VariantArgs
from kernelgen.errors import InputError, InputTypeError
from kernelgen.runtime.frameworks import arrays_of, module_of, pointer_of
from kernelgen.specs.forward import DTYPE_BYTES, KernelSpec

__all__ = ["attention_with_kvcache"]


def attention_with_kvcache(
    q: Any,
    k_cache: Any,
    v_cache: Any,
    cache_seqlens: Any,
    *,
    block_table: Any = None,
    k_new: Any = None,
    v_new: Any = None,
    causal: bool = False,
    scale: float | None = None,
    return_lse: bool = False,
    spec: KernelSpec | None = None,
    num_splits: int | None = None,
    validate: bool = False,
    window_size: tuple[int, int] | None = None,
    softcap: float | None = None,
    alibi_slopes: Any = None,
    sinks: Any = None,
    score_mod: Any = None,
    mask_mod: Any = None,
    mod_inputs: Mapping[str, Any] | None = None,
    q_descale: Any = None,
    k_descale: Any = None,
    v_descale: Any = None,
) -> Any:
    """Attention of q over a KV cache, after appending ``k_new``/``v_new`` in place.

    q is (B, Sq, H, D) with H % Hkv == 0, "bshd" layout. The cache, per tensor, is contiguous
    (B, S_max, Hkv, D) without ``block_table``, or paged (num_pages, page_size, Hkv, D) with
    ``block_table``, int32 (B, pages per sequence): key j of entry b is row j % page_size of
    page ``block_table[b, j // page_size]`` (page_size a multiple of 16; pages in any order,
    shared between entries too; entries past a sequence's pages are never read). The cache
    holds S_max = pages per sequence x page_size keys per entry then. ``cache_seqlens`` gives
    each batch entry's valid keys: an int (every entry), a list of ints, or an int32 (B,) array
    (NumPy, or q's library on q's device); ``block_table`` likewise (host or q's library).

    With ``k_new`` and ``v_new`` (B, S_new, Hkv, D, the cache's dtype), row s of entry b is
    written to key ``cache_seqlens[b] + s`` of the entry before attending, so q sees
    ``cache_seqlens[b] + S_new`` keys; every ``cache_seqlens[b] + S_new`` must be at most
    S_max, no paged row written may hold a valid key of any entry or be written twice, and the
    caches may neither repeat an element (stride 0) nor share memory with each other or with
    ``k_new``/``v_new``. Device ``cache_seqlens`` and ``block_table`` are then read back to the
    host (one synchronisation; refused while a CUDA graph is being captured) and checked like
    host ones. Without ``k_new``, q sees ``cache_seqlens[b]`` keys and device metadata is not
    read (the kernels clamp lengths to [0, S_max] and trust the block table) unless
    ``validate=True``: that checks device lengths and the block-table entries they use (in
    range, no page twice in a row) on the device, with the arrays' library (one
    synchronisation), before any launch. The call does not advance ``cache_seqlens``: the
    caller adds S_new for the next step (as with flash-attn).

    ``causal`` is bottom-right aligned to each entry's updated length: query i of Sq sees key j
    iff ``j <= i + cache_seqlens[b] + S_new - Sq`` (with Sq == S_new, each new token sees the
    cache and the new tokens up to itself). ``scale``, ``spec``, ``num_splits`` and
    ``return_lse`` as in ``attention()`` (a paged cache needs a ``paged_kv`` spec). Returns out
    (B, Sq, H, D) in q's dtype and library, and with ``return_lse`` the fp32 LSE of shape
    (B, H, Sq). Every check runs before the cache is written: a call that raises leaves it
    unchanged. The variants (``window_size``, ``softcap``, ``alibi_slopes``, ``sinks``;
    docs/variants.md) as in ``attention()``, aligned like ``causal`` to each entry's updated
    length. User expressions (``score_mod``, ``mask_mod``, ``mod_inputs``; docs/expressions.md)
    as in ``attention()``: ``kv_idx`` is the key's position in its entry's cache and ``q_idx``
    the query's row in [0, Sq) (write the entry's offset into the expression or an input).

    fp8: q, the caches and k_new/v_new all ``float8_e4m3fn``, with optional float32 (B, Hkv)
    ``q_descale``/``k_descale``/``v_descale`` as in ``attention()``; out is bfloat16. The cache
    is read in place (the kernel transposes V in shared memory), contiguous or paged (pages of
    a multiple of the spec's block_n): :mod:`kernelgen.calls.kvcache_fp8`.
    """
    variants = VariantArgs(window_size, softcap, alibi_slopes, sinks, score_mod, mask_mod,
                           mod_inputs)  # fmt: skip
    descales = {"q_descale": q_descale, "k_descale": k_descale, "v_descale": v_descale}
    if wants_fp8(q, k_cache, v_cache, *descales.values()):
        check_flags(causal=causal, return_lse=return_lse, validate=validate)
        return fp8_attention_with_kvcache(
            q, k_cache, v_cache, cache_seqlens, block_table=block_table, k_new=k_new,
            v_new=v_new, causal=causal, scale=scale, return_lse=return_lse, spec=spec,
            num_splits=num_splits, validate=validate, variants=variants, descales=descales,
        )  # fmt: skip
    check_flags(causal=causal, return_lse=return_lse, validate=validate)
    infos = [describe(x, n) for x, n in ((q, "q"), (k_cache, "k_cache"), (v_cache, "v_cache"))]
    paged = block_table is not None
    for t in infos:
        if len(t.shape) != 4:
            shape = "(num_pages, page_size, Hkv, D)" if paged else "(B, S_max, Hkv, D)"
            shape = "(B, Sq, H, D)" if t.name == "q" else shape
            raise InputError(
                f"{t.name} has rank {len(t.shape)} (shape {t.shape}); expected rank 4, {shape}"
            )
    q_info, k_info, v_info = infos
    if k_info.shape != v_info.shape:
        raise InputError(
            f"k_cache has shape {k_info.shape} but v_cache has {v_info.shape}; they must match"
        )
    if k_info.strides != v_info.strides and paged:
        raise InputError(
            f"k_cache has strides {k_info.strides} but v_cache has {v_info.strides}; a paged "
            "cache's two tensors must share their layout"
        )
    batch = q_info.shape[0]
    layout = paged_layout(k_info, block_table, batch) if paged else None
    if layout is None and k_info.shape[0] != batch:
        raise InputError(f"k_cache has batch {k_info.shape[0]} but q has batch {batch}")
    kernel_infos = [q_info] + [as_batched(t, layout) for t in (k_info, v_info)]
    call = check_inputs(
        *kernel_infos, None, layout="bshd", scale=scale, spec=spec, causal=bool(causal),
        variants=variants,
    )  # fmt: skip
    check_expression_libraries(q, call.expressions)
    # the kernels' parameter names (errors above named the caches)
    call = replace(call, k=replace(call.k, name="k"), v=replace(call.v, name="v"))
    num_splits = check_num_splits(num_splits, spec)
    max_keys = call.k.shape[2]  # S_max: keys each entry can hold
    appending = k_new is not None or v_new is not None
    new_infos = check_new(k_new, v_new, kernel_infos[1]) if appending else []
    new_len = int(new_infos[0].shape[1]) if appending else 0
    if appending:
        libraries = {n: module_of(x) for n, x in _named(q, k_cache, v_cache, k_new, v_new)}
        if (
            any(lib not in LIBRARIES for lib in libraries.values())
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
    lengths = cache_lengths(cache_seqlens, batch, q)
    table = layout.host_table if layout is not None else None
    device = common_device(
        {
            "q": q,
            "k_cache": k_cache,
            "v_cache": v_cache,
            "k_new": k_new,
            "v_new": v_new,
            "cache_seqlens": None if lengths is not None else cache_seqlens,
            "block_table": None if not paged or table is not None else block_table,
            **variants.arrays(),
            **call.expressions.named_arrays(),
        }
    )
    if appending:
        _check_write_targets(k_info, v_info, *new_infos)
    arrays = arrays_of(q)
    with arrays.scope(device):
        lengths, table = read_metadata(
            appending, validate, cache_seqlens, block_table, lengths, table, max_keys, layout
        )
        if lengths is not None:
            check_lengths(lengths, new_len, max_keys, layout.page_size if layout else 0)
            seqlens_k: Any = (lengths + new_len).astype(np.int32)
        else:
            seqlens_k = cache_seqlens
        slots = None
        if layout is not None:
            if lengths is not None and table is not None:
                check_pages(table, lengths + new_len, layout)
                if appending and new_len:
                    slots = paged_slots(table, lengths, new_len, layout)
            paging = Paging(
                layout.page_size, layout.kernel_table, layout.row_stride, layout.num_pages
            )
        else:
            paging = None
        call_plan, tensors, temporaries = checked_plan(
            call, bool(causal), seqlens_k, spec, num_splits, "bshd", arrays, device, paging
        )
        if appending and new_len:
            if layout is None:
                append_rows(k_cache, k_new, lengths, new_len)
                append_rows(v_cache, v_new, lengths, new_len)
            else:
                append_paged_rows(k_cache, k_new, *slots)
                append_paged_rows(v_cache, v_new, *slots)
        out, lse = call_plan.launch_outputs(tensors, bool(return_lse))
        del temporaries  # each library frees in stream order: safe once queued
    return (out, lse) if return_lse else out


def _named(*arrays: Any) -> list[tuple[str, Any]]:
    return list(zip(("q", "k_cache", "v_cache", "k_new", "v_new"), arrays, strict=True))


MAX_OVERLAP_WORK = 1 << 16  # NumPy's exact overlap test: search bound (then: assumed overlapping)
_TOO_HARD = getattr(np, "exceptions", np).TooHardError  # numpy.exceptions from NumPy 1.25


def _check_write_targets(
    k_cache: TensorInfo, v_cache: TensorInfo, k_new: TensorInfo, v_new: TensorInfo
) -> None:
    """The caches the call writes into hold each element once and share no memory with each
    other or with k_new/v_new, which they are written from (otherwise a write could change
    what a later write reads, or land twice): checked on metadata before the first write."""
    for cache in (k_cache, v_cache):
        problem = _self_overlap(cache)
        if problem:
            raise InputError(
                f"{cache.name} has shape {cache.shape} and strides {cache.strides}: {problem}; "
                "the call writes k_new/v_new into it in place, so each element needs its own "
                "memory (pass a cache that is not a broadcast or expanded view)"
            )
    for first, second in ((k_cache, v_cache), (k_new, k_cache), (k_new, v_cache)):
        _check_disjoint(first, second)
    for cache in (k_cache, v_cache):
        _check_disjoint(v_new, cache)


def _self_overlap(t: TensorInfo) -> str | None:
    """Why two elements of ``t`` may share one memory location, or None: a stride 0 along a
    dimension of more than one element, or strides that do not nest (each dimension's stride,
    taken by size, beyond the span of the smaller ones: a sufficient test)."""
    sizes = enumerate(zip(t.shape, t.strides, strict=True))
    dims = sorted((abs(stride), n, d) for d, (n, stride) in sizes if n > 1)
    span = 0  # elements from the first to the last of the dimensions so far
    for stride, size, dim in dims:
        if stride == 0:
            return f"stride 0 along dimension {dim} (size {size}) repeats its elements"
        if stride <= span:
            return f"stride {stride} along dimension {dim} lands inside the smaller dimensions"
        span += (size - 1) * stride
    return None


def _check_disjoint(first: TensorInfo, second: TensorInfo) -> None:
    """Raise an InputError naming both when ``first`` and ``second`` may share memory."""
    if first.source is second.source:
        shared = True
    else:
        views = [_address_view(t) for t in (first, second)]
        try:
            shared = np.shares_memory(*views, max_work=MAX_OVERLAP_WORK)
        except _TOO_HARD:
            shared = True
    if shared:
        raise InputError(
            f"{first.name} shares memory with {second.name}; the call writes k_new/v_new into "
            "k_cache/v_cache in place, so the four must be separate arrays (copy one of them)"
        )


def _address_view(t: TensorInfo) -> np.ndarray:
    """A NumPy array with ``t``'s address, shape and strides, for NumPy's overlap test, which
    reads the layout only: its memory (a device's, possibly) is never touched."""
    itemsize = DTYPE_BYTES[t.dtype]
    interface = {
        "version": 3,
        "shape": t.shape,
        "strides": tuple(s * itemsize for s in t.strides),
        "typestr": f"|V{itemsize}",
        "data": (pointer_of(t.source), True),
    }
    return np.asarray(_Interface(interface))


class _Interface:
    """An object exposing a given ``__array_interface__``."""

    def __init__(self, interface: dict[str, Any]) -> None:
        self.__array_interface__ = interface
