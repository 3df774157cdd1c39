"""``kernelgen.attention_with_kvcache`` on an fp8 (e4m3) cache (docs/hopper.md, "fp8 decode").

q, k_cache and v_cache (and k_new/v_new) are ``float8_e4m3fn`` with float32 (B, Hkv) descales,
out is bfloat16. The cache is read in place: the fp8 kernel takes V transposed in shared
memory (``fp8_v_layout: kernel``), so no V^T copy of the cache is made per step. Without a
spec (and without ``num_splits`` or user expressions) a call on a 9.0 GPU runs the autotuner's
choice among the fp8 forms of the Hopper decode grid (spec and split count; the page size is
part of its key: :func:`kernelgen.tuning.candidates.wgmma_decode_fields`); otherwise, and with
``KERNELGEN_AUTOTUNE=0``, :func:`~kernelgen.model.policy.fp8_decode_spec` (split-KV, packed GQA
where the group divides 64 rows; with ``block_table``, paged KV at 64-key tiles). A paged fp8 cache
takes pages of any multiple of 16 keys, as a 16-bit one: pages of a multiple of the spec's
block_n are one TMA copy per key tile, others are copied row by row with cp.async before the
in-kernel transpose. As for 16-bit caches, every check comes before ``k_new``/``v_new`` are
written.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np

from kernelgen.calls import attention as api
from kernelgen.calls import kvcache_inputs
from kernelgen.calls.attention import Paging, check_num_splits, describe
from kernelgen.calls.expression_inputs import with_expressions
from kernelgen.calls.fp8 import FP8_CAPABILITY, check_fp8_call, fp8_attention
from kernelgen.calls.kvcache_checks import (
    check_lengths,
    check_pages,
    paged_slots,
)
from kernelgen.calls.variant_inputs import VariantArgs
from kernelgen.errors import InputError
from kernelgen.model.policy import fp8_decode_spec
from kernelgen.runtime.frameworks import arrays_of
from kernelgen.specs.forward import KernelSpec

__all__ = ["fp8_attention_with_kvcache"]


def fp8_attention_with_kvcache(
    q: Any,
    k_cache: Any,
    v_cache: Any,
    cache_seqlens: Any,
    *,
    block_table: Any,
    k_new: Any,
    v_new: Any,
    causal: bool,
    scale: float | None,
    return_lse: bool,
    spec: KernelSpec | None,
    num_splits: int | None,
    validate: bool,
    variants: VariantArgs,
    descales: dict[str, Any],
) -> Any:
    """:func:`kernelgen.attention_with_kvcache` for fp8 inputs (the arguments as there)."""
    paged = block_table is not None
    k_info, v_info = describe(k_cache, "k_cache"), describe(v_cache, "v_cache")
    layout = kv_infos = paging = None
    if paged:  # the pools as (B, S_max, Hkv, D) views, checked as for 16-bit caches
        if k_info.shape != v_info.shape or k_info.strides != v_info.strides:
            raise InputError(
                f"k_cache has shape {k_info.shape} and strides {k_info.strides} but v_cache "
                f"{v_info.shape} and {v_info.strides}; a paged cache's two tensors must share "
                "their layout"
            )
        batch = describe(q, "q").shape[0]
        layout = kvcache_inputs.paged_layout(k_info, block_table, batch)
        kv_infos = tuple(
            replace(kvcache_inputs.as_batched(t, layout), name=name)
            for t, name in ((k_info, "k"), (v_info, "v"))
        )
        paging = Paging(layout.page_size, layout.kernel_table, layout.row_stride, layout.num_pages)

    def checked(named: KernelSpec | None) -> Any:
        return check_fp8_call(
            q, k_cache, v_cache, causal=causal, scale=scale, spec=named, return_lse=return_lse,
            layout="bshd", descales=descales, unsupported={}, variants=variants,
            kv_infos=kv_infos,
        )  # fmt: skip

    call = checked(spec).call  # shapes, dtypes, descales, variants: before anything is written
    batch, heads, _, head_dim = call.q.shape  # (B, H, Sq, D) whatever the layout
    kv_heads, max_keys = call.k.shape[1], call.k.shape[2]
    if spec is None:
        arrays = arrays_of(q)
        tuned = num_splits is None and not call.expressions.present and not arrays.host
        if tuned and api.device_arch()[0] == FP8_CAPABILITY:  # (elsewhere fp8_attention refuses)
            page_size = layout.page_size if layout is not None else 0
            launch = api.tuned_launch(call, bool(causal), arrays.name, page_size=page_size)
            spec, num_splits = launch.spec, launch.num_splits
        else:
            flags = call.variants.flags
            spec = fp8_decode_spec(head_dim, causal, heads // kv_heads, flags, paged_kv=paged)
            spec = with_expressions(spec, call.expressions)
        checked(spec)
    num_splits = check_num_splits(num_splits, spec)
    appending = k_new is not None or v_new is not None
    new_len = 0
    if appending:
        cache_info = kv_infos[0] if kv_infos else k_info
        new_len = int(kvcache_inputs.check_new(k_new, v_new, cache_info)[0].shape[1])
        for name, x in (("k_cache", k_cache), ("v_cache", v_cache)):
            if isinstance(x, np.ndarray) and not x.flags.writeable:
                raise InputError(f"{name} is read-only; the call writes k_new/v_new into it")
    lengths = kvcache_inputs.cache_lengths(cache_seqlens, batch, q)
    table = layout.host_table if layout is not None else None
    lengths, table = kvcache_inputs.read_metadata(
        appending, validate, cache_seqlens, block_table, lengths, table, max_keys, layout
    )
    seqlens_k: Any = cache_seqlens
    if lengths is not None:
        check_lengths(lengths, new_len, max_keys, layout.page_size if layout else 0)
        seqlens_k = (lengths + new_len).astype(np.int32)
        if layout is not None and table is not None:
            check_pages(table, lengths + new_len, layout)
    if appending and new_len:
        if layout is None:
            kvcache_inputs.append_rows(k_cache, k_new, lengths, new_len)
            kvcache_inputs.append_rows(v_cache, v_new, lengths, new_len)
        else:
            slots = paged_slots(table, lengths, new_len, layout)
            kvcache_inputs.append_paged_rows(k_cache, k_new, *slots)
            kvcache_inputs.append_paged_rows(v_cache, v_new, *slots)
    return fp8_attention(
        q, k_cache, v_cache, causal=causal, scale=scale, spec=spec, return_lse=return_lse,
        layout="bshd", descales=descales, unsupported={}, variants=variants,
        seqlens_k=seqlens_k, num_splits=num_splits, paging=paging, kv_infos=kv_infos,
    )  # fmt: skip
