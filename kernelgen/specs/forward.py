"""Kernel specs: a frozen Pydantic model, its validation, derived tile geometry and canonical name.

A spec is everything that is a compile-time constant of a generated kernel. Its canonical name
(``uri``) is the kernel symbol, the file name under generated/ and the cache identity.
"""

from __future__ import annotations

import copy
import functools
import json
import math
import numbers
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_serializer,
    model_validator,
)

from kernelgen.errors import InputError, SpecError
from kernelgen.specs.arch import ARCHS, DEFAULT_ARCHS
from kernelgen.specs.engines import ENGINES, Engine, EngineName
from kernelgen.specs.expressions import (
    Expression,
    ModInput,
    spec_expressions,
)

DType = Literal["float32", "float16", "bfloat16", "float8_e4m3"]
LoopOrder = Literal["v1", "v2"]
MmaPath = EngineName
SmemLayout = Literal["padded", "swizzled"]
# How the wgmma forward writes out (docs/hopper.md, "TMA-store epilogue"): straight from the
# accumulators, or through a swizzled shared-memory tile (stmatrix) and one TMA store per block.
Epilogue = Literal["direct", "tma"]
EPILOGUE_TAGS = {"direct": "", "tma": "tma"}
# Where the fp8 forward's V^T operand comes from (docs/hopper.md, "fp8", "V transposed in the
# kernel"): a host copy per call, or the caller's V by TMA, transposed in shared memory by the
# producer warpgroup. The uri tag of each.
FP8VLayout = Literal["host", "kernel"]
FP8_V_LAYOUT_TAGS = {"host": "", "kernel": "vk"}
# Thread blocks per cluster of the wgmma forward (docs/hopper.md, "2-CTA clusters"): 1, or 2
# blocks of adjacent query tiles sharing each K/V tile by TMA multicast.
CLUSTER_SIZES = (1, 2)

DTYPE_BYTES: dict[str, int] = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3": 1}
DTYPE_SHORT: dict[str, str] = {
    "float32": "f32",
    "float16": "f16",
    "bfloat16": "bf16",
    "float8_e4m3": "e4m3",
}
# fp8 inputs (docs/hopper.md, "fp8"): the element type of q, k and v -> that of out (split-KV's
# combine writes it too; its partials are fp32). Every other dtype writes out in its own type.
FP8_DTYPE = "float8_e4m3"  # the fp8 kernels' input dtype (OCP e4m3)
FP8_OUTPUT_DTYPE: dict[str, str] = {FP8_DTYPE: "bfloat16"}
# What fp8 on the wgmma engine is built for: head dim -> the key tiles it takes (docs/hopper.md,
# fp8). A Q or K tile row is stored in 128-byte column blocks (d64: one 64-byte-swizzled row;
# d96: one 128-byte row whose last 32 bytes TMA zero-fills; d192: two, the second half-filled),
# a V^T tile is head-dim rows of block_n bytes (n128: 128-byte swizzle, n64: 64-byte), so its
# tile may be smaller than K's (k_tile_bytes, v_tile_bytes). d256 takes 64-key tiles only: its
# 128 fp32 output accumulators per thread leave room for 32 of scores, not 64
# (live_registers_per_thread).
FP8_BLOCK_N_BY_HEAD_DIM: dict[int, tuple[int, ...]] = {
    64: (128, 64),
    96: (128, 64),
    128: (128, 64),
    192: (128, 64),
    256: (64,),
}
FP8_HEAD_DIMS = tuple(FP8_BLOCK_N_BY_HEAD_DIM)
# Every dtype name kernelgen's functions and CLI accept -> the full name (the one table).
DTYPE_ALIASES: dict[str, str] = {
    "float32": "float32",
    "fp32": "float32",
    "f32": "float32",
    "float": "float32",
    "float16": "float16",
    "fp16": "float16",
    "f16": "float16",
    "half": "float16",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
}


def normalize_dtype(name: str) -> str:
    """``bf16`` -> ``bfloat16`` etc.; raises :class:`InputError` naming the allowed values for
    anything else."""
    try:
        return DTYPE_ALIASES[str(name).lower()]
    except KeyError:
        raise InputError(
            f"dtype={name!r} is not allowed; use one of {', '.join(DTYPE_ALIASES)}"
        ) from None


TILE_SIZES = (16, 32, 64, 128)  # the CUDA-core (simt) kernels' tiles
# Tensor-core (mma_sync) tiles: key tiles are whole k16 steps of O += P V (multiples of 16 up to
# 128, e.g. 48: at head dim 128 a 32-row warp holds 32 x (48 + 128) / 32 = 176 accumulators);
# query tiles are num_warps x 16 or 32 rows, up to 8 warps of 32 rows.
TILE_STEP = 16  # every tile is whole m16 / k16 steps
MAX_BLOCK_N = 128  # simt and mma_sync (and the block masks, which are mma_sync's)
WGMMA_MAX_BLOCK_N = 256  # wgmma: its largest n, and TMA's largest box
MAX_BLOCK_M = 256
WARP_COUNTS = (1, 2, 4, 8, 12)  # 12: wgmma's producer warpgroup and two consumer warpgroups
MAX_HEAD_DIM = 256
# fp32 registers a thread may devote to its slice of the output row and of the score row;
# beyond this the kernels spill (checked for real by ptxas in the compile tier).
MAX_ACCUMULATORS_PER_THREAD = {name: e.max_accumulators for name, e in ENGINES.items()}
MMA_STAGES = (2, 3, 4)
# Query rows one warp owns on the tensor cores: one or two m16 tiles (two share each K/V fragment).
MMA_ROWS_PER_WARP = (16, 32)
# Tensor-core rows are moved in 16-byte chunks (8 elements): the padded layout adds one chunk per
# row (an odd row stride in chunks), the swizzled one XORs the chunk index with the row (mod 8).
MMA_PAD_WORDS = {"padded": 4, "swizzled": 0}
# wgmma (sm_90a): a consumer warpgroup (4 warps) owns 64 query rows (the m64 of wgmma), one more
# warpgroup produces (issues the TMA copies). Head dims: the tiles are 64-element column blocks
# of 128 bytes (the 128-byte swizzle); 96 fills the second block half (TMA zero-fills the rest),
# 192 is three blocks, 256 four.
WGMMA_ARCHS = (ENGINES["wgmma"].arch_target,)
WGMMA_HEAD_DIMS = (64, 96, 128, 192, 256)
PINNED_V_MAX_HEAD_DIM = 128  # the widest head dim whose V descriptors are pinned (below)
WGMMA_BLOCK_M = (64, 128)  # one or two consumer warpgroups
# Keys per tile: any multiple of 16 (one k-step of P V; whole 8-row swizzle atoms, also for a
# 2-CTA cluster's halves) up to 256 (wgmma's largest n and TMA's largest box), as the
# accumulator budget allows: e.g. 176 at head dim 128 (FlashAttention 3's non-causal tile).
WGMMA_BLOCK_N = tuple(range(32, WGMMA_MAX_BLOCK_N + 1, TILE_STEP))
# A consumer thread's accumulators plus P's A fragments (block_n x element bytes / 8 registers)
# that ptxas compiles without spilling, sm_90a, 240 registers per consumer: 212 (d64 n240,
# d128 n192: 208, d128 n176: 196) compiled without; d64 n256 (224) spilled 96 bytes.
WGMMA_MAX_LIVE = 212
# The engine's accumulator budget (engines.py: 168, FlashAttention 3's 128 x 80 tile at head
# dim 256 needs it) holds everywhere but for the overlap with Q in registers, where ptxas
# serialized every product at 168 (d96 n128, d128 n96: its note C7512) and compiled 160 and
# below without; 20 specs of 161-168 accumulators compiled with no spill or stack (sm_90a).
WGMMA_OVERLAP_QR_MAX_ACCUMULATORS = 160
WGMMA_ROWS_PER_WARPGROUP = 64
WGMMA_COLUMN_BLOCK = 64  # elements of one 128-byte swizzled row (16-bit types)
WGMMA_ROW_BYTES = 128  # one swizzled row: 64 16-bit or 128 fp8 elements
# The swizzle spans a tile row may take (TMA's CU_TENSOR_MAP_SWIZZLE_<n>B), smallest first: a
# row is the smallest span that holds its padded bytes, at most one 128-byte column block.
WGMMA_SWIZZLE_SPANS = (64, WGMMA_ROW_BYTES)
PARTIAL_BYTES = 4  # split-KV's partial outputs are fp32
WGMMA_SWIZZLE_ATOM = 1024  # bytes: 8 rows of 128 bytes, the repeat of the 128-byte swizzle
WGMMA_BARRIER_BYTES = 8


def padded_head_dim(head_dim: int) -> int:
    """Head dim rounded up to the mma k-step of 16 (the extra columns are zeros in smem)."""
    return -(-head_dim // 16) * 16


def swizzle_fits(head_dim: int) -> bool:
    """The XOR swizzle permutes groups of 8 chunks of 16 bytes: the padded row must hold whole
    groups (fp16/bf16: a multiple of 64 elements)."""
    return padded_head_dim(head_dim) % 64 == 0


def default_smem_layout(head_dim: int) -> SmemLayout:
    """The tensor-core layout kernelgen picks when a spec is not given one: swizzled where the
    swizzle fits (no padding bytes), else padded."""
    return "swizzled" if swizzle_fits(head_dim) else "padded"


# The built-in attention variants a spec may be compiled with (docs/variants.md): the spec flag
# -> its tag in the kernel name. Their values (window bounds, cap, slopes, sinks) are run-time
# arguments, so one kernel serves every window size and cap.
VARIANT_FLAGS = ("window", "softcap", "alibi", "sinks")
VARIANT_TAGS = {"window": "win", "softcap": "cap", "alibi": "alibi", "sinks": "sink"}
# User expressions (docs/expressions.md): spec field -> its tag in the kernel name, followed by
# the expression's hash (canonical text and declared inputs).
EXPRESSION_FIELDS = ("score_mod", "mask_mod")
EXPRESSION_TAGS = {"score_mod": "smod", "mask_mod": "mmod"}


def tile_size_problem(name: str, value: object, block_n_limit: int = MAX_BLOCK_N) -> str | None:
    """What is wrong with ``value`` as ``block_m`` or ``block_n`` on any path (None: nothing):
    a multiple of 16 up to :data:`MAX_BLOCK_M` / ``block_n_limit``. Each path narrows it
    (simt: :data:`TILE_SIZES`; mma_sync: block_m = rows per warp x num_warps, block_n up to
    :data:`MAX_BLOCK_N`; wgmma: its own)."""
    limit = MAX_BLOCK_M if name == "block_m" else block_n_limit
    if type(value) is int and 0 < value <= limit and value % TILE_STEP == 0:
        return None
    rule = (
        f"16 or 32 rows per warp times num_warps, up to {limit}"
        if name == "block_m"
        else f"any multiple of {TILE_STEP} up to {limit}"
    )
    wgmma = f"; wgmma: up to {WGMMA_MAX_BLOCK_N}" if name == "block_n" else ""
    return (
        f"{name}={value!r} is not allowed; use one of {', '.join(map(str, TILE_SIZES))} "
        f"(mma_sync: {rule}{wgmma})"
    )


def _power_of_two_choice(field: str, value: int, allowed: tuple[int, ...]) -> int:
    if value not in allowed:
        raise ValueError(
            f"{field}={value} is not allowed; use one of {', '.join(map(str, allowed))}"
        )
    return value


# ---- field checks every family's spec shares (their validators call these) ------------------
def strict_integer(field: str, value: Any) -> int:
    """An integer field's value: integers only (a NumPy integer too): ``true`` is not 1, ``64.0``
    is not 64 and the string ``'64'`` is not 64."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(
            f"{field}={_echo(value)} is not allowed; use an integer ({type(value).__name__} given)"
        )
    return int(value)


def strict_boolean(field: str, value: Any) -> bool:
    """A boolean field's value: true or false only (a NumPy bool too; not 1, 0 or 'yes')."""
    if type(value).__module__ == "numpy" and type(value).__name__ in ("bool", "bool_"):
        return bool(value)
    if not isinstance(value, bool):
        raise ValueError(f"{field}={_echo(value)} is not allowed; use true or false")
    return value


def checked_head_dim(value: int) -> int:
    """head_dim: a multiple of 8 from 8 to :data:`MAX_HEAD_DIM`."""
    if value <= 0 or value % 8 or value > MAX_HEAD_DIM:
        raise ValueError(
            f"head_dim={value} is not allowed; use a multiple of 8 from 8 to {MAX_HEAD_DIM}"
        )
    return value


def checked_archs(value: tuple[str, ...]) -> tuple[str, ...]:
    """archs: a non-empty list of the architectures of :data:`kernelgen.specs.arch.ARCHS`."""
    if not value or any(a not in ARCHS for a in value):
        raise ValueError(
            f"archs={list(value)} is not allowed; use a non-empty list of {', '.join(ARCHS)}"
        )
    return tuple(value)


class KernelSpec(BaseModel):
    """A FlashAttention forward kernel, fully determined (all fields are compile-time)."""

    model_config = ConfigDict(frozen=True, extra="forbid", validate_default=True)

    loop_order: LoopOrder = Field(
        description="v1: FA1 order (outer loop over K/V tiles, running state in global memory); "
        "v2: FA2 order (a thread block per Q tile, state in registers)."
    )
    dtype: DType = Field(
        description="Element type of q, k, v and out (accumulation is fp32). float8_e4m3 "
        "(mma: wgmma only): q, k, v in e4m3 with per (batch, kv head) descales, out in bfloat16."
    )
    head_dim: int = Field(description="Head dimension D: a multiple of 8, at most 256.")
    block_m: int = Field(
        description="Query rows per tile: 16, 32, 64 or 128 (mma_sync: 16 or 32 rows per warp "
        "times num_warps, up to 256)."
    )
    block_n: int = Field(
        description="Key rows per tile: 16, 32, 64 or 128 (mma_sync: any multiple of 16 up to 128; "
        "wgmma: any multiple of 16 from 32 to 256 the accumulators allow, e.g. 176 at d128)."
    )
    num_warps: int = Field(
        4,
        description="Warps per thread block (1, 2, 4 or 8; wgmma: 4 per warpgroup, a producer "
        "and block_m / 64 consumers, i.e. 8 or 12, its default).",
    )
    causal: bool = Field(False, description="Bottom-right aligned causal mask.")
    mma: MmaPath = Field(
        "simt",
        description="simt: CUDA-core FMA kernels (all dtypes, v1 and v2); mma_sync: tensor cores "
        "(mma.sync m16n8k16, ldmatrix, cp.async; float16/bfloat16, v2, block_m = 16 or 32 rows "
        "per warp times num_warps); wgmma: Hopper tensor cores (archs [sm_90a] only: wgmma, TMA, "
        "mbarriers; float16/bfloat16 (and float8_e4m3), v2, head_dim 64/96/128/192/256, block_m "
        "64 or 128 = one or two consumer warpgroups, block_n a multiple of 16 from 32 to 256 "
        "within the registers and shared memory).",
    )
    stages: int | None = Field(
        None,  # resolved by _fill_mode_defaults: 1 for simt, 2 for mma_sync
        description="K/V tiles in flight (cp.async pipeline depth): 2 to 4 for mma_sync; 1 for "
        "simt. Defaults to 2 (mma_sync) or 1 (simt).",
    )
    smem_layout: SmemLayout = Field(
        "padded",
        description="Shared-memory layout of the Q, K, V tiles: padded rows, or XOR-swizzled "
        "16-byte chunks (mma_sync only; needs head_dim rounded up to 16 to be a multiple of 64).",
    )
    smem_pad: int | None = Field(
        None,  # resolved by _fill_mode_defaults
        description="Extra 32-bit words at the end of each shared-memory row of Q, K and V. "
        "simt: 0 to 8, default 1 (an odd stride in words spreads a tile's rows over the banks). "
        "mma_sync: fixed by smem_layout (4 = one 16-byte chunk when padded, 0 when swizzled).",
    )
    pack_gqa: bool = Field(
        False,
        description="Pack the query heads that share a key/value head into the rows of one tile "
        "(row = query * group + head), so each K/V tile is read once per key/value head, not "
        "once per query head: the decode layout (tensor cores; wgmma: block_m must be a "
        "multiple of the call's group H/Hkv).",
    )
    split_kv: bool = Field(
        False,
        description="Split the key axis into chunks (their count is chosen at launch): each "
        "thread block writes its chunk's output and LSE in fp32, and a generated combine kernel "
        "folds them with the attention monoid (loop_order v2 only).",
    )
    paged_kv: bool = Field(
        False,
        description="K and V live in a paged cache (num_pages, page_size, Hkv, D): key j of "
        "batch entry b is row j % page_size of page block_table[b, j / page_size]; page_size and "
        "the block table are launch arguments (loop_order v2 only; wgmma copies a key tile from "
        "one page with TMA when page_size is a multiple of block_n, else row by row with "
        "cp.async).",
    )
    additive_mask: bool = Field(
        False,
        description="The kernel reads an additive mask (attention(mask=...)). A call with a mask "
        "runs its spec with this set (the API adds it); kernels without it hold no register "
        "for the mask across the key-tile loop.",
    )
    window: bool = Field(
        False,
        description="Sliding-window attention: query i sees keys i + offset - left .. i + offset "
        "+ right (offset = seqlen_k - seqlen_q; left and right are run-time arguments, -1 "
        "unbounded); key tiles outside a query tile's window are never visited.",
    )
    softcap: bool = Field(
        False,
        description="Score soft-capping s <- c * tanh(s / c), the cap c a run-time argument.",
    )
    alibi: bool = Field(
        False,
        description="ALiBi: s <- s - slope * |i + offset - j|, slopes per head (or per batch and "
        "head) a run-time fp32 array.",
    )
    sinks: bool = Field(
        False,
        description="Attention sinks: a per-head fp32 logit (run-time array) that joins each "
        "row's softmax denominator and its lse.",
    )
    score_mod: str | None = Field(
        None,
        description="A user expression giving the new score (docs/expressions.md), e.g. "
        "'score + bias[h, q_idx, kv_idx]': score is scale * q.k after softcap; b, h, q_idx, "
        "kv_idx the indices; inputs as declared in mod_inputs. Stored in canonical form.",
    )
    mask_mod: str | None = Field(
        None,
        description="A user expression, true where key kv_idx is visible to query q_idx "
        "(docs/expressions.md), e.g. 'doc[b, q_idx] == doc[b, kv_idx]'. Stored in canonical "
        "form.",
    )
    mod_inputs: tuple[str, ...] = Field(
        (),
        description="The extra arrays score_mod and mask_mod read, as name:dtype[rank] (e.g. "
        "doc:int32[2]); passed to attention() as mod_inputs={name: array}.",
    )
    block_sparse: bool = Field(
        False,
        description="Visit only the key tiles a block mask of mask_mod lists (attention(..., "
        "block_mask=kernelgen.block_mask(...))); fully visible tiles skip the per-element "
        "mask_mod. mma_sync or wgmma (every wgmma loop: plain, overlap, q_in_registers, "
        "pingpong, epilogue tma); not with split_kv, paged_kv, pack_gqa, cluster_m > 1 or fp8.",
    )
    overlap: bool = Field(
        False,
        description="wgmma only: overlap each key tile's softmax with the previous tile's P V "
        "inside a warpgroup (FlashAttention 3's intra-warpgroup pipelining; block_n / 4 more "
        "registers per thread: the new tile's fp32 weights beside the 16-bit ones in flight).",
    )
    q_in_registers: bool = Field(
        False,
        description="wgmma only: each consumer loads its Q rows into registers "
        "once (the A operand of every Q K^T) instead of wgmma re-reading them from shared "
        "memory for every key tile (head_dim / 4 more registers per thread).",
    )
    pingpong: bool = Field(
        False,
        description="wgmma only, two consumer warpgroups (block_m 128): the warpgroups take "
        "turns issuing their products on two named barriers (each key tile's Q K^T; with "
        "overlap, each step's Q K^T and P V together), so one warpgroup's softmax runs while "
        "the other's products are on the tensor cores (FlashAttention 3's inter-warpgroup "
        "scheduling).",
    )
    epilogue: Epilogue = Field(
        "direct",
        description="wgmma only: how out is written. direct: 4-byte stores from the "
        "accumulators; tma: each consumer warpgroup converts its 64 rows to 16 bits, writes them "
        "into its rows of the Q tile with stmatrix (128-byte swizzled) and one thread copies "
        "them out with a TMA store (pack_gqa: a 5-d out map; fp8: the bf16 rows take one more "
        "column block of shared memory; split_kv: the fp32 partials, through st.shared, with "
        "as many more blocks as their rows need).",
    )
    cluster_m: int = Field(
        1,
        description="wgmma only: thread blocks per cluster along the query tiles (1 or 2). "
        "With 2, two blocks of adjacent query tiles of one head share every K and V tile: each "
        "block's producer copies half of it by TMA multicast into both blocks, halving the "
        "K/V traffic from L2 (FlashAttention 3's 2-CTA clusters; not causal, window, "
        "split_kv, paged_kv or fp8, whose blocks visit different key tiles).",
    )
    fp8_v_layout: FP8VLayout = Field(
        "host",
        description="fp8 (float8_e4m3) only: where P V's V^T operand comes from. host: a "
        "transposed, key-permuted copy of v made once per call (kernelgen.runtime.fp8."
        "v_operand); kernel: the caller's v by TMA into a staging ring, transposed in shared "
        "memory by the producer warpgroup (no copy, no extra memory).",
    )
    archs: tuple[str, ...] = Field(
        DEFAULT_ARCHS,
        description="GPU architectures the spec must fit (shared memory is checked against each).",
    )

    @model_validator(mode="before")
    @classmethod
    def _fill_mode_defaults(cls, data: Any) -> Any:
        """Defaults that depend on the mma path, so a dumped spec always holds explicit values."""
        if not isinstance(data, dict):
            return data
        data = dict(data)
        mma = data.get("mma", "simt")
        engine = ENGINES.get(mma) if isinstance(mma, str) else None  # else: the field's error
        tensor_cores = engine is not None and engine.tensor_cores
        if engine is not None and engine.warp_specialized:  # one layout and one target
            data.setdefault("smem_layout", "swizzled")
            data.setdefault("archs", WGMMA_ARCHS)
            if isinstance(data.get("block_m"), int) and "num_warps" not in data:
                data["num_warps"] = 4 * (1 + data["block_m"] // WGMMA_ROWS_PER_WARPGROUP)
        if data.get("stages") is None:
            data["stages"] = engine.default_stages if engine is not None else 1
        if data.get("smem_pad") is None:
            layout = data.get("smem_layout", "padded")
            data["smem_pad"] = MMA_PAD_WORDS.get(layout, 0) if tensor_cores else 1
        return data

    @model_serializer(mode="wrap")
    def _drop_unused_variants(self, handler: Any) -> dict[str, Any]:
        """Variant flags that are off are left out of dumps (YAML, JSON, cache identities), so a
        spec without variants keeps the identity it had before variants existed; so are wgmma's
        loop switches when off and the fields whose default came later (epilogue direct,
        cluster_m 1, fp8_v_layout host)."""
        data = handler(self)
        for name in (
            *VARIANT_FLAGS, "block_sparse", "overlap", "pingpong", "q_in_registers", "additive_mask"
        ):  # fmt: skip
            if data.get(name) is False:
                del data[name]
        for name in EXPRESSION_FIELDS:
            if data.get(name) is None:
                data.pop(name, None)  # absent already under exclude_defaults
        if not data.get("mod_inputs"):
            data.pop("mod_inputs", None)
        if data.get("epilogue") == "direct":  # the default keeps the identities it had
            del data["epilogue"]
        if data.get("cluster_m") == 1:
            del data["cluster_m"]
        if data.get("fp8_v_layout") == "host":
            del data["fp8_v_layout"]
        return data

    @model_validator(mode="before")
    @classmethod
    def _canonical_expressions(cls, data: Any) -> Any:
        return canonical_expression_fields(data)

    # ---- field checks -------------------------------------------------------------------
    @field_validator(
        "head_dim",
        "block_m",
        "block_n",
        "num_warps",
        "stages",
        "smem_pad",
        "cluster_m",
        mode="before",
    )
    @classmethod
    def _strict_integer(cls, value: Any, info: Any) -> Any:
        """Integer fields take integers only (a NumPy integer too): ``true`` is not 1, ``64.0``
        is not 64 and the string ``'64'`` is not 64."""
        if value is None and info.field_name in ("stages", "smem_pad"):
            return value
        return strict_integer(info.field_name, value)

    @field_validator(
        "causal",
        "pack_gqa",
        "split_kv",
        "paged_kv",
        "window",
        "softcap",
        "alibi",
        "sinks",
        "block_sparse",
        "overlap",
        "pingpong",
        "q_in_registers",
        "additive_mask",
        mode="before",
    )
    @classmethod
    def _strict_boolean(cls, value: Any, info: Any) -> Any:
        """Boolean fields take true or false only (not 1, 0 or the string 'yes')."""
        return strict_boolean(info.field_name, value)

    @field_validator("head_dim")
    @classmethod
    def _check_head_dim(cls, value: int) -> int:
        return checked_head_dim(value)

    @field_validator("block_m", "block_n")
    @classmethod
    def _check_tile(cls, value: int, info: Any) -> int:
        # the widest path's limit here; each path checks its own (_mma_problems, ...)
        problem = tile_size_problem(info.field_name, value, WGMMA_MAX_BLOCK_N)
        if problem:
            raise ValueError(problem)
        return value

    @field_validator("num_warps")
    @classmethod
    def _check_num_warps(cls, value: int) -> int:
        return _power_of_two_choice("num_warps", value, WARP_COUNTS)

    @field_validator("smem_pad")
    @classmethod
    def _check_smem_pad(cls, value: int) -> int:
        if not 0 <= value <= 8:
            raise ValueError(f"smem_pad={value} is not allowed; use 0 to 8 (32-bit words)")
        return value

    @field_validator("archs")
    @classmethod
    def _check_archs(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        return checked_archs(value)

    # ---- whole-spec checks ----------------------------------------------------------------
    @model_validator(mode="after")
    def _check_geometry(self) -> KernelSpec:
        if self.fp8 and self.dtype not in self.engine.dtypes:
            raise ValueError(
                f"dtype={self.dtype!r} is not allowed with mma={self.mma!r}; use one of "
                f"{', '.join(self.engine.dtypes)}"
                + (" (float8_e4m3 needs mma: wgmma)" if self.fp8 else "")
            )
        problems = {
            "simt": self._simt_problems,
            "mma_sync": self._mma_problems,
            "wgmma": self._wgmma_problems,
        }[self.engine.name]()
        if problems:  # the geometry below is meaningless for a spec with a wrong mode
            raise ValueError("\n".join(problems))
        if self.threads < self.block_m:
            problems.append(
                f"num_warps={self.num_warps} gives {self.threads} threads, fewer than "
                f"block_m={self.block_m} rows; use num_warps >= {max(1, self.block_m // 32)}"
            )
        elif self.accumulators_per_thread > self.engine.max_accumulators:
            problems.append(
                f"block_m={self.block_m}, block_n={self.block_n}, head_dim={self.head_dim} with "
                f"num_warps={self.num_warps} need {self.accumulators_per_thread} fp32 "
                f"accumulators per thread; at most {self.engine.max_accumulators} fit in "
                "registers "
                + (
                    "(lower block_n)"
                    if self.engine.warp_specialized
                    else "(raise num_warps or lower the tiles)"
                )
            )
        elif (
            self.overlap
            and self.q_in_registers
            and self.accumulators_per_thread > WGMMA_OVERLAP_QR_MAX_ACCUMULATORS
        ):
            problems.append(
                f"overlap=true with q_in_registers=true at block_n={self.block_n}, "
                f"head_dim={self.head_dim} needs {self.accumulators_per_thread} fp32 "
                f"accumulators per thread; at most {WGMMA_OVERLAP_QR_MAX_ACCUMULATORS} fit "
                "with both (ptxas serializes the products; lower block_n or drop one)"
            )
        elif self.engine.warp_specialized and self.live_registers_per_thread > WGMMA_MAX_LIVE:
            problems.append(
                f"block_n={self.block_n}, head_dim={self.head_dim} need "
                f"{self.accumulators_per_thread} fp32 accumulators and "
                f"{self.live_registers_per_thread - self.accumulators_per_thread} registers of P "
                f"per thread; more than {WGMMA_MAX_LIVE} together spill (lower block_n)"
            )
        problems += self._expression_problems()
        wgmma = self.engine.warp_specialized
        if not wgmma and self.overlap:
            problems.append(
                f"overlap=true is not allowed with mma={self.mma!r}; it pipelines wgmma products "
                "(use mma: wgmma)"
            )
        if self.pingpong and (not wgmma or self.block_m != 128):
            problems.append(
                f"pingpong=true is not allowed with mma={self.mma!r}, block_m={self.block_m}; "
                "it alternates two consumer warpgroups (use mma: wgmma, block_m: 128)"
            )
        if self.q_in_registers and not wgmma:
            problems.append(
                f"q_in_registers=true is not allowed with mma={self.mma!r}; it is the wgmma "
                "kernels' register A operand of Q K^T (use mma: wgmma)"
            )
        if self.epilogue != "direct":
            problems += self._epilogue_problems()
        if self.cluster_m != 1:
            problems += self._cluster_problems()
        if self.fp8_v_layout != "host" and not self.fp8:
            problems.append(
                f"fp8_v_layout={self.fp8_v_layout!r} is not allowed with dtype={self.dtype!r}; "
                "it is where an fp8 (float8_e4m3) kernel's V^T comes from (leave it out)"
            )
        if not wgmma and self.num_warps == 12:
            problems.append(
                f"num_warps=12 is not allowed with mma={self.mma!r}; use 1, 2, 4 or 8 (12 is "
                "wgmma's producer and two consumer warpgroups)"
            )
        for name in self.archs:
            limit = ARCHS[name].max_smem_per_block
            if self.smem_bytes > limit:
                problems.append(
                    f"shared memory {self.smem_bytes} bytes exceeds the {limit}-byte limit of "
                    f"{name}; lower block_m/block_n or drop {name} from archs"
                )
        if problems:
            raise ValueError("\n".join(problems))
        return self

    def _cluster_problems(self) -> list[str]:
        """What ``cluster_m: 2`` needs: the wgmma engine, and the two blocks of a cluster
        visiting the same key tiles (each copies half of every tile for both)."""
        if self.cluster_m not in CLUSTER_SIZES:
            allowed = " or ".join(map(str, CLUSTER_SIZES))
            return [f"cluster_m={self.cluster_m} is not allowed; use {allowed}"]
        why = {
            "mma": (
                not self.engine.warp_specialized,
                "the multicast copies are the wgmma kernel's producer's",
            ),
            "causal": (self.causal, "the two blocks would visit different key tiles"),
            "window": (self.window, "the two blocks would visit different key tiles"),
            "split_kv": (self.split_kv, "a decode kernel has one query tile per head"),
            "paged_kv": (self.paged_kv, "a decode kernel has one query tile per head"),
            "dtype": (self.fp8, "fp8's V^T tile is not split for multicast (not built yet)"),
            "block_sparse": (self.block_sparse, "the two blocks would visit different key tiles"),
        }
        return [
            f"cluster_m={self.cluster_m} is not allowed with {field}={_echo(getattr(self, field))}"
            f": {reason}; use cluster_m: 1"
            for field, (refused, reason) in why.items()
            if refused
        ]

    def _epilogue_problems(self) -> list[str]:
        """What ``epilogue: tma`` needs: the wgmma engine, 16-bit out rows of whole queries."""
        why = {
            "mma": (
                not self.engine.warp_specialized,
                "the TMA store is an epilogue of the wgmma kernel's consumer warpgroups",
            ),
        }
        return [
            f"epilogue={self.epilogue!r} is not allowed with {field}={_echo(getattr(self, field))}"
            f": {reason}; use epilogue: direct"
            for field, (refused, reason) in why.items()
            if refused
        ]

    def _expression_problems(self) -> list[str]:
        problems = []
        if self.mod_inputs and not self.has_expressions:
            problems.append(
                "mod_inputs are declared but the spec has no score_mod or mask_mod; remove them"
            )
        if self.block_sparse:
            if self.mask_mod is None:
                problems.append(
                    "block_sparse=true needs a mask_mod (the block mask lists its key tiles)"
                )
            if not self.engine.block_sparse:
                allowed = " or ".join(name for name, e in ENGINES.items() if e.block_sparse)
                problems.append(
                    f"block_sparse=true is not allowed with mma={self.mma!r}; use {allowed}"
                )
            for field in ("split_kv", "paged_kv", "pack_gqa"):
                if getattr(self, field):
                    problems.append(
                        f"block_sparse=true is not allowed with {field}=true (a block mask "
                        "lists key tiles per query tile of one head and the whole key range)"
                    )
        return problems

    def _simt_problems(self) -> list[str]:
        problems = [
            f"{name}={value} is not allowed with mma='simt'; use one of "
            f"{', '.join(map(str, TILE_SIZES))}"
            for name, value in (("block_m", self.block_m), ("block_n", self.block_n))
            if value not in TILE_SIZES
        ]
        if self.stages != 1:
            problems.append(f"stages={self.stages} is not allowed with mma='simt'; use 1")
        if self.smem_layout != "padded":
            problems.append(
                f"smem_layout={self.smem_layout!r} is not allowed with mma='simt'; use 'padded'"
            )
        if self.pack_gqa:
            problems.append(
                "pack_gqa=true is not allowed with mma='simt'; use mma: mma_sync (float16/bfloat16)"
            )
        if self.split_kv and self.loop_order != "v2":
            problems.append(
                f"split_kv=true is not allowed with loop_order={self.loop_order!r}; use v2 (a "
                "block per query tile and key chunk)"
            )
        if self.paged_kv and self.loop_order != "v2":
            problems.append(
                f"paged_kv=true is not allowed with loop_order={self.loop_order!r}; use v2 (a "
                "block per query tile looks up each key tile's page)"
            )
        return problems

    def _mma_problems(self) -> list[str]:
        problems = []
        if self.dtype == "float32":
            problems.append(
                "dtype='float32' is not allowed with mma='mma_sync'; use float16 or bfloat16 "
                "(or mma: simt)"
            )
        if self.loop_order != "v2":
            problems.append(
                f"loop_order={self.loop_order!r} is not allowed with mma='mma_sync'; use v2"
            )
        if self.block_m not in (rows * self.num_warps for rows in MMA_ROWS_PER_WARP):
            allowed = " or ".join(str(rows * self.num_warps) for rows in MMA_ROWS_PER_WARP)
            problems.append(
                f"block_m={self.block_m} is not allowed with num_warps={self.num_warps} and "
                "mma='mma_sync'; each warp owns "
                f"{' or '.join(map(str, MMA_ROWS_PER_WARP))} query rows, so use block_m={allowed}"
            )
        if self.block_n > MAX_BLOCK_N:
            problems.append(
                f"block_n={self.block_n} is not allowed with mma='mma_sync'; use a multiple of "
                f"{TILE_STEP} up to {MAX_BLOCK_N} (mma: wgmma takes up to {WGMMA_MAX_BLOCK_N})"
            )
        if self.stages not in MMA_STAGES:
            problems.append(
                f"stages={self.stages} is not allowed with mma='mma_sync'; use one of "
                f"{', '.join(map(str, MMA_STAGES))}"
            )
        if self.smem_pad != MMA_PAD_WORDS[self.smem_layout]:
            problems.append(
                f"smem_pad={self.smem_pad} is not allowed with mma='mma_sync' and smem_layout="
                f"{self.smem_layout!r}; leave it out (it is {MMA_PAD_WORDS[self.smem_layout]})"
            )
        if self.smem_layout == "swizzled" and not swizzle_fits(self.head_dim):
            problems.append(
                f"smem_layout='swizzled' is not allowed with head_dim={self.head_dim}: the swizzle "
                "permutes 8 chunks of 16 bytes, so head_dim rounded up to 16 must be a multiple "
                "of 64; use smem_layout='padded'"
            )
        return problems

    def _wgmma_problems(self) -> list[str]:
        problems = []
        if self.dtype == "float32":
            problems.append(
                "dtype='float32' is not allowed with mma='wgmma'; use float16 or bfloat16"
            )
        if self.loop_order != "v2":
            problems.append(
                f"loop_order={self.loop_order!r} is not allowed with mma='wgmma'; use v2"
            )
        other = [a for a in self.archs if a not in WGMMA_ARCHS]
        if other:
            problems.append(
                f"archs={list(self.archs)} is not allowed with mma='wgmma'; wgmma and setmaxnreg "
                f"exist only on {', '.join(WGMMA_ARCHS)} (use archs: [{', '.join(WGMMA_ARCHS)}])"
            )
        if self.head_dim not in WGMMA_HEAD_DIMS:
            problems.append(
                f"head_dim={self.head_dim} is not allowed with mma='wgmma'; use one of "
                f"{', '.join(map(str, WGMMA_HEAD_DIMS))}"
            )
        if self.block_m not in WGMMA_BLOCK_M:
            problems.append(
                f"block_m={self.block_m} is not allowed with mma='wgmma'; each consumer "
                f"warpgroup owns {WGMMA_ROWS_PER_WARPGROUP} query rows, so use "
                f"{' or '.join(map(str, WGMMA_BLOCK_M))}"
            )
        elif self.num_warps != self.wgmma_warps:
            problems.append(
                f"num_warps={self.num_warps} is not allowed with mma='wgmma' and block_m="
                f"{self.block_m}; use {self.wgmma_warps} (a producer warpgroup and "
                f"{self.block_m // WGMMA_ROWS_PER_WARPGROUP} consumer warpgroups), or leave it out"
            )
        if self.block_n not in WGMMA_BLOCK_N:
            problems.append(
                f"block_n={self.block_n} is not allowed with mma='wgmma'; use a multiple of 16 "
                f"from {WGMMA_BLOCK_N[0]} to {WGMMA_BLOCK_N[-1]}"
            )
        if self.stages not in MMA_STAGES:
            problems.append(
                f"stages={self.stages} is not allowed with mma='wgmma'; use one of "
                f"{', '.join(map(str, MMA_STAGES))}"
            )
        if self.smem_layout != "swizzled" or self.smem_pad != 0:
            problems.append(
                f"smem_layout={self.smem_layout!r}, smem_pad={self.smem_pad} are not allowed "
                "with mma='wgmma'; its tiles are always 128-byte swizzled (leave both out)"
            )
        if self.fp8:
            problems += self._fp8_problems()
        return problems

    def _fp8_problems(self) -> list[str]:
        """What an fp8 wgmma spec may not have (yet): docs/hopper.md, "fp8"."""
        problems = []
        block_ns = FP8_BLOCK_N_BY_HEAD_DIM.get(self.head_dim)
        if block_ns is None:
            problems.append(
                f"head_dim={self.head_dim} is not allowed with dtype={self.dtype!r}; use "
                f"{' or '.join(map(str, FP8_HEAD_DIMS))}"
            )
        elif self.block_n not in block_ns:
            problems.append(
                f"block_n={self.block_n} is not allowed with dtype={self.dtype!r} and head_dim="
                f"{self.head_dim}; use {' or '.join(map(str, block_ns))}"
            )
        if self.epilogue == "tma" and self.qk_row_bytes < WGMMA_ROW_BYTES:
            problems.append(
                f"epilogue='tma' is not allowed with dtype={self.dtype!r} and head_dim="
                f"{self.head_dim} (not built yet: the bf16 rows it stages are wider than the "
                "64-byte Q rows); use epilogue: direct"
            )
        # The built-in variants, user expressions and block-sparse masks are allowed (they act
        # on the descaled scores and the key tiles' positions); the decode forms are not.
        # The decode forms read a cache in place: with V transposed in the kernel only (the
        # host layout would copy the cache's V^T every step); a paged fp8 cache takes pages of
        # any multiple of 16 keys, as 16-bit ones (tensor_maps.check_wgmma_decode).
        for field in ("pack_gqa", "split_kv", "paged_kv"):
            value = getattr(self, field)
            if value and not self.v_transposed_in_kernel:
                problems.append(
                    f"{field}={_echo(value)} is not allowed with dtype={self.dtype!r} and "
                    f"fp8_v_layout={self.fp8_v_layout!r} (a decode form reads the cache in "
                    "place); use fp8_v_layout: kernel"
                )
        return problems

    # ---- derived geometry (single source for render, launch and validation) --------------
    @property
    def fp8(self) -> bool:
        """q, k and v are fp8 (out is :attr:`out_dtype`)."""
        return self.dtype in FP8_OUTPUT_DTYPE

    @property
    def out_dtype(self) -> str:
        """Element type of out: bfloat16 for fp8 inputs, else the spec's dtype."""
        return FP8_OUTPUT_DTYPE.get(self.dtype, self.dtype)

    @property
    def row_elems(self) -> int:
        """wgmma: elements of one swizzled Q or K tile row (a column block's width): 128 bytes,
        or the smallest swizzle span that holds a shorter padded row (fp8 at d64: 64 bytes; fp8
        at d96: 128, its last 32 bytes zero-filled by TMA)."""
        row = self.head_dim_padded * self.elem_bytes
        span = next((s for s in WGMMA_SWIZZLE_SPANS if s >= row), WGMMA_ROW_BYTES)
        return span // self.elem_bytes

    @property
    def qk_row_bytes(self) -> int:
        """wgmma: bytes of one swizzled Q or K tile row, which is also its swizzle span (TMA's
        CU_TENSOR_MAP_SWIZZLE_<n>B, the descriptors' layout type): 128, or 64 (fp8 at d64)."""
        return self.row_elems * self.elem_bytes

    @property
    def v_row_bytes(self) -> int:
        """wgmma: bytes of one swizzled V tile row and its swizzle span: fp8 reads V^T, rows of
        block_n 1-byte keys (128 or 64); else as :attr:`qk_row_bytes`."""
        return self.block_n if self.fp8 else self.qk_row_bytes

    @property
    def k_tile_bytes(self) -> int:
        """wgmma: bytes of one K tile in shared memory (a ring slot of k_ring): block_n rows of
        :attr:`column_blocks` swizzled rows."""
        return self.block_n * self.column_blocks * self.qk_row_bytes

    @property
    def v_tile_bytes(self) -> int:
        """wgmma: bytes of one V tile (a ring slot of v_ring): as a K tile, or for fp8 the V^T
        box, head-dim rows of block_n 1-byte keys (d96, d192: fewer than K's padded rows)."""
        return self.head_dim_padded * self.block_n if self.fp8 else self.k_tile_bytes

    @property
    def v_transposed_in_kernel(self) -> bool:
        """fp8 with ``fp8_v_layout: kernel``: V lands by TMA in a staging ring (K's layout) and
        the producer warpgroup writes the V^T slots."""
        return self.fp8 and self.fp8_v_layout == "kernel"

    @property
    def v_staging_bytes(self) -> int:
        """wgmma: bytes of the V staging ring (``fp8_v_layout: kernel``: one K-shaped tile per
        stage), else 0."""
        return self.stages * self.k_tile_bytes if self.v_transposed_in_kernel else 0

    @property
    def engine(self) -> Engine:
        """The row of this spec's engine (:mod:`kernelgen.specs.engines`)."""
        return ENGINES[self.mma]

    @property
    def wgmma_warps(self) -> int:
        """Warps of a wgmma block: the producer warpgroup and one consumer warpgroup per 64
        query rows."""
        return 4 * (1 + self.block_m // WGMMA_ROWS_PER_WARPGROUP)

    @property
    def consumer_warpgroups(self) -> int:
        """wgmma: warpgroups that compute (each owns 64 query rows of the tile)."""
        return self.block_m // WGMMA_ROWS_PER_WARPGROUP

    @property
    def column_blocks(self) -> int:
        """wgmma: 64-element (128-byte) column blocks a Q, K or V tile row is stored in."""
        return -(-self.head_dim // self.row_elems)

    @property
    def pins_v_descriptors(self) -> bool:
        """wgmma: V's descriptors built once before the key loop, as K's are with Q in
        registers (docs/hopper.md, "K's descriptors"): 16-bit operands, the loops without the
        overlap, head dims up to :data:`PINNED_V_MAX_HEAD_DIM`. Measured offline (the loop's
        encoded stall cycles, NVRTC 13.5): 1.2-2.8 % fewer at d64-d128; the 3-stage overlap
        8-10 % more, fp8 and d192-d256 within +-1 %."""
        return (
            self.engine.warp_specialized  # the wgmma engine's descriptors
            and not self.fp8
            and not self.overlap
            and self.head_dim <= PINNED_V_MAX_HEAD_DIM
        )

    @property
    def out_column_blocks(self) -> int:
        """wgmma, ``epilogue: tma``: 128-byte column blocks of one staged output row: 64
        columns of 16-bit out each (fp8's bf16 rows are twice as wide as its 1-byte Q rows), or
        with split-KV 32 columns of the fp32 partial."""
        elem = PARTIAL_BYTES if self.split_kv else DTYPE_BYTES[self.out_dtype]
        return -(-self.head_dim * elem // WGMMA_ROW_BYTES)

    @property
    def q_region_blocks(self) -> int:
        """wgmma: column blocks of block_m rows before the K/V ring: the Q tile's, or with the
        TMA-store epilogue as many as out needs (the epilogue stages out in the Q tile's rows
        and, past its column blocks, in the extra ones: docs/hopper.md)."""
        if self.epilogue == "tma":
            return max(self.column_blocks, self.out_column_blocks)
        return self.column_blocks

    @property
    def threads(self) -> int:
        return self.num_warps * 32

    @property
    def threads_per_row(self) -> int:
        """Lanes of one warp that share a query row (its scores and its output columns).

        simt: 1 to 16, never more than block_n. mma_sync and wgmma: the 4 lanes of a quad,
        which the m16n8 (and m64nN) accumulator layout gives 2 of each 8 columns of rows g and
        g + 8."""
        if self.engine.threads_per_row is not None:
            return self.engine.threads_per_row
        return max(1, self.threads // self.block_m)

    @property
    def rows_per_warp(self) -> int:
        """Query rows of the tile that one warp owns (mma_sync: 16 or 32, the m16 tiles; wgmma:
        16, a consumer warp's quarter of its warpgroup's 64)."""
        if self.engine.warp_specialized:
            return WGMMA_ROWS_PER_WARPGROUP // 4
        return self.block_m // self.num_warps

    @property
    def keys_per_thread(self) -> int:
        return self.block_n // self.threads_per_row

    @property
    def cols_per_thread(self) -> int:
        return math.ceil(self.head_dim / self.threads_per_row)

    @property
    def head_dim_padded(self) -> int:
        """Head dim rounded up to the mma k-step of 16 (the extra columns are zeros in smem)."""
        return padded_head_dim(self.head_dim)

    @property
    def elem_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def smem_row_elems(self) -> int:
        """Row stride of the Q, K and V tiles in shared memory, in elements."""
        if self.engine.warp_specialized:
            return self.row_elems  # one swizzled row of a column block (qk_row_bytes)
        width = self.head_dim_padded if self.engine.tensor_cores else self.head_dim
        return width + self.smem_pad * 4 // self.elem_bytes

    @property
    def prob_row_floats(self) -> int:
        """Row stride of the fp32 probability tile: one extra word keeps its rows in other banks."""
        return self.block_n + 1

    @property
    def accumulators_per_thread(self) -> int:
        if self.engine.tensor_cores:  # a warp's rows of scores and output, 32 lanes
            # A fragments of 16 rows x n input-type elements (P, Q) over 32 lanes' 4-byte
            # registers: n * elem_bytes / 8 per lane (n / 4 at 16 bits, n / 8 for fp8).
            # The overlap keeps a tile's fp32 weights beside the rounded ones P V reads.
            overlapped = self.block_n * self.elem_bytes // 8 if self.overlap else 0
            q_fragments = self.head_dim_padded * self.elem_bytes // 8 if self.q_in_registers else 0
            return (
                self.rows_per_warp * (self.block_n + self.head_dim_padded) // 32
                + overlapped
                + q_fragments
            )
        return self.keys_per_thread + self.cols_per_thread

    def row_tiles(self, rows: int) -> int:
        """The grid's blocks for one head's ``rows`` (query rows, or packed (query, head) rows):
        ceil(rows / block_m), rounded up to whole clusters with ``cluster_m`` (a block past the
        rows copies its share of the key tiles for the others and writes nothing)."""
        return math.ceil(rows / (self.block_m * self.cluster_m)) * self.cluster_m

    @property
    def live_registers_per_thread(self) -> int:
        """:attr:`accumulators_per_thread` plus the registers of P, the weights rounded to the
        input type as the A operand of P V (tensor-core kernels)."""
        return self.accumulators_per_thread + self.block_n * self.elem_bytes // 8

    @property
    def smem_bytes(self) -> int:
        row_bytes = self.smem_row_elems * self.elem_bytes
        if self.engine.warp_specialized:  # Q, K and V rings, their barriers, 1024-byte alignment
            q_bytes = self.block_m * self.q_region_blocks * row_bytes
            kv_bytes = self.stages * (self.k_tile_bytes + self.v_tile_bytes)
            # Q landed; per slot K landed, V landed, slot free; the last V tile staged; paged:
            # per slot K and V copied by cp.async (pages that are no multiple of block_n; fp8:
            # K only, V's copies complete its staged-V barrier); block-sparse (never paged):
            # per slot the index of its key tile (in 8 bytes)
            copied = (1 if self.fp8 else 2) if self.paged_kv else 0
            slot_barriers = (3 + copied + int(self.block_sparse)) * self.stages
            # V transposed in the kernel: per slot, the staged V tile landed
            slot_barriers += self.stages if self.v_transposed_in_kernel else 0
            barriers = (2 + slot_barriers) * WGMMA_BARRIER_BYTES
            return q_bytes + kv_bytes + self.v_staging_bytes + barriers + WGMMA_SWIZZLE_ATOM
        if self.engine.tensor_cores:  # Q tile (reused to stage the output), then K and V rings
            return (self.block_m + 2 * self.stages * self.block_n) * row_bytes
        return (
            self.block_m + 2 * self.block_n
        ) * row_bytes + self.block_m * self.prob_row_floats * 4

    @property
    def uri(self) -> str:
        """Canonical readable name, e.g. ``fa_fwd_v2_f16_d128_m64_n64_w4_p1_causal`` or
        ``fa_fwd_v2_tc_bf16_d128_m16_n64_w1_s3_swz_gqa_split``."""
        engine = self.engine
        parts = ["fa_fwd", self.loop_order] + ([engine.uri_tag] if engine.uri_tag else [])
        parts += [
            DTYPE_SHORT[self.dtype],
            f"d{self.head_dim}",
            f"m{self.block_m}",
            f"n{self.block_n}",
            f"w{self.num_warps}",
        ]
        if engine.warp_specialized:
            parts.append(
                f"s{self.stages}"
                + ("_ovl" if self.overlap else "")
                + ("_pp" if self.pingpong else "")
                + ("_qr" if self.q_in_registers else "")
                + (f"_{EPILOGUE_TAGS[self.epilogue]}" if EPILOGUE_TAGS[self.epilogue] else "")
                + (f"_c{self.cluster_m}" if self.cluster_m > 1 else "")
                + (
                    f"_{FP8_V_LAYOUT_TAGS[self.fp8_v_layout]}"
                    if FP8_V_LAYOUT_TAGS[self.fp8_v_layout]
                    else ""
                )
            )
        elif engine.tensor_cores:
            parts += [f"s{self.stages}", "swz" if self.smem_layout == "swizzled" else "pad"]
        else:
            parts.append(f"p{self.smem_pad}")
        if self.causal:
            parts.append("causal")
        if self.pack_gqa:
            parts.append("gqa")
        if self.split_kv:
            parts.append("split")
        if self.paged_kv:
            parts.append("paged")
        if self.additive_mask:
            parts.append("amask")
        parts += [VARIANT_TAGS[name] for name in VARIANT_FLAGS if getattr(self, name)]
        parts += [f"{EXPRESSION_TAGS[e.kind]}{e.hash}" for e in self.expressions if e is not None]
        if self.block_sparse:
            parts.append("bsparse")
        return "_".join(parts)

    def compile_arch(self, device_arch: str) -> str:
        """The target to compile for on a device of ``device_arch``: the arch-specific sm_90a
        for wgmma specs (which run on 9.0 devices only), else the device's own."""
        return self.engine.arch_target or device_arch

    def with_additive_mask(self) -> KernelSpec:
        """This spec reading an additive mask (itself when it already does): what a call with a
        mask runs."""
        return self if self.additive_mask else _with_additive_mask(self)

    @property
    def variants(self) -> tuple[str, ...]:
        """The built-in variants the kernel is compiled with, in :data:`VARIANT_FLAGS` order."""
        return tuple(name for name in VARIANT_FLAGS if getattr(self, name))

    @property
    def expressions(self) -> tuple[Expression | None, Expression | None]:
        """The checked (score_mod, mask_mod), None where the spec has none."""
        return _cached_expressions(self.score_mod, self.mask_mod, self.mod_inputs)[:2]

    @property
    def declared_inputs(self) -> tuple[ModInput, ...]:
        """The arrays the expressions read (``mod_inputs`` as ModInputs, name order)."""
        return _cached_expressions(self.score_mod, self.mask_mod, self.mod_inputs)[2]

    @property
    def has_expressions(self) -> bool:
        return self.score_mod is not None or self.mask_mod is not None

    @property
    def combine_uri(self) -> str:
        """Symbol of the split-KV combine kernel generated next to the main one."""
        return f"{self.uri}_combine"

    def canonical_json(self) -> str:
        """The spec as sorted, compact JSON: the content that identifies the kernel."""
        return json.dumps(self.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)


def canonical_expression_fields(data: Any) -> Any:
    """A spec mapping (of any family) with score_mod and mask_mod checked against mod_inputs
    and stored in canonical form (inputs in name order), so that equal expressions give equal
    specs, names and caches; raises ValueError (the validator's error) otherwise."""
    if not isinstance(data, dict) or not any(
        data.get(name) is not None for name in (*EXPRESSION_FIELDS, "mod_inputs")
    ):
        return data
    data = dict(data)
    texts = [data.get(name) for name in EXPRESSION_FIELDS]
    for name, text in zip(EXPRESSION_FIELDS, texts, strict=True):
        if text is not None and not isinstance(text, str):
            raise ValueError(f"{name}={_echo(text)} is not allowed; use a string expression")
    signatures = data.get("mod_inputs") or ()
    if isinstance(signatures, str) or not isinstance(signatures, (list, tuple)):
        raise ValueError(
            f"mod_inputs={_echo(signatures)} is not allowed; use a list of name:dtype[rank]"
        )
    try:
        score, mask, declared = spec_expressions(*texts, signatures)
    except SpecError as exc:
        raise ValueError("\n".join(exc.problems)) from None
    data["score_mod"] = None if score is None else score.text
    data["mask_mod"] = None if mask is None else mask.text
    data["mod_inputs"] = tuple(i.signature for i in declared)
    return data


@functools.lru_cache(maxsize=256)
def _cached_expressions(
    score_mod: str | None, mask_mod: str | None, mod_inputs: tuple[str, ...]
) -> tuple[Expression | None, Expression | None, tuple[ModInput, ...]]:
    return spec_expressions(score_mod, mask_mod, mod_inputs)


# ---- loading ----------------------------------------------------------------------------
def format_validation_error(exc: ValidationError, fields: Any = None) -> list[str]:
    """One readable line per problem: the field, the value and what is allowed (``fields``: the
    model's fields, for the list an unknown field's message gives; default a KernelSpec's)."""
    lines = []
    for err in exc.errors():
        field = ".".join(str(p) for p in err["loc"]) or "spec"
        message = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            allowed = ", ".join(fields if fields is not None else KernelSpec.model_fields)
            message = (
                f"unknown field {_echo(field)} (value {_echo(err['input'])}); "
                f"allowed fields: {allowed}"
            )
        elif err["type"] == "missing":
            message = f"missing required field {field!r}"
        elif err["type"] == "literal_error":
            message = f"{field}={_echo(err['input'])} is not allowed; {message}"
        elif field != "spec" and not message.startswith(field.split(".")[0]):
            message = f"{field}={_echo(err['input'])}: {message}"
        lines.extend(message.splitlines())  # a whole-spec check may report several problems
    return lines


def spec_from_dict(data: Any, source: str | None = None) -> KernelSpec:
    """Validate a mapping into a spec, raising :class:`SpecError` with one line per problem."""
    if not isinstance(data, dict):
        raise SpecError([f"expected a mapping of spec fields, got {type(data).__name__}"], source)
    try:
        return KernelSpec.model_validate(data)
    except ValidationError as exc:
        try:
            problems = format_validation_error(exc)
        except RecursionError:  # echoing a value nested thousands of levels deep
            problems = [f"values nested more than {MAX_SPEC_DEPTH} levels deep are not allowed"]
        raise SpecError(problems, source) from None
    except RecursionError:
        raise SpecError(
            [f"values nested more than {MAX_SPEC_DEPTH} levels deep are not allowed"], source
        ) from None


MAX_SPEC_BYTES = 1 << 20  # a spec is a dozen short lines; refuse anything near this size
MAX_SPEC_DEPTH = 32  # nested YAML collections; a spec needs three or four levels
MAX_ECHO_CHARS = 80  # values echoed in error messages are cut to this many characters


def _echo(value: Any) -> str:
    """``repr(value)`` cut to :data:`MAX_ECHO_CHARS` characters (no 2 MB line for a 2 MB value)."""
    text = repr(value)
    return text if len(text) <= MAX_ECHO_CHARS else text[: MAX_ECHO_CHARS - 3] + "..."


class _SpecLoader(yaml.SafeLoader):
    """YAML's safe loader without aliases (a spec never needs one; nested aliases expand
    exponentially, the 'billion laughs'), with duplicate keys an error, not the last one, and
    collections nested at most :data:`MAX_SPEC_DEPTH` deep (deeper ones would exhaust Python's
    recursion limit)."""

    _depth = 0

    def compose_node(self, parent, index):  # type: ignore[no-untyped-def]
        if self._depth >= MAX_SPEC_DEPTH:
            raise yaml.composer.ComposerError(
                None,
                None,
                f"values nested more than {MAX_SPEC_DEPTH} levels deep are not allowed",
                self.peek_event().start_mark,
            )
        self._depth += 1
        try:
            return self._compose_checked(parent, index)
        finally:
            self._depth -= 1

    def _compose_checked(self, parent, index):  # type: ignore[no-untyped-def]
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise yaml.composer.ComposerError(
                None, None, "YAML aliases (*name) are not allowed in a spec", event.start_mark
            )
        event = self.peek_event()
        anchor = getattr(event, "anchor", None)
        if anchor is not None:
            raise yaml.composer.ComposerError(
                None, None, "YAML anchors (&name) are not allowed in a spec", event.start_mark
            )
        return super().compose_node(parent, index)

    def construct_mapping(self, node, deep=False):  # type: ignore[no-untyped-def]
        seen: dict[Any, Any] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            try:
                duplicate = key in seen
            except TypeError:  # an unhashable key: let the base class report it
                break
            if duplicate:
                raise yaml.constructor.ConstructorError(
                    None,
                    None,
                    f"duplicate key {_echo(key)} (first at line {seen[key].line + 1})",
                    key_node.start_mark,
                )
            seen[key] = key_node.start_mark
        return super().construct_mapping(node, deep=deep)


_SpecLoader.add_constructor(
    yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _SpecLoader.construct_mapping
)


def parse_spec_yaml(text: str) -> Any:
    """Parse a spec document with :class:`_SpecLoader` (raises ``yaml.YAMLError``)."""
    return yaml.load(text, Loader=_SpecLoader)  # a SafeLoader subclass


@functools.lru_cache(maxsize=256)
def _parsed_spec_text(text: str) -> Any:
    """:func:`parse_spec_yaml` once per distinct text: the test suite reads the same spec files
    hundreds of times, and the YAML parser (pure Python) was most of a read."""
    return parse_spec_yaml(text)


def load_spec(path: str | Path) -> KernelSpec:
    """Read one spec from a YAML file (safe loading, UTF-8, at most 1 MiB, no aliases, no
    duplicate keys)."""
    return spec_from_dict(load_spec_data(path), str(path))


def load_spec_data(path: str | Path) -> Any:
    """The parsed YAML of a spec file (any family), read safely: UTF-8, at most 1 MiB, no
    aliases, no duplicate keys; raises :class:`SpecError` naming the file."""
    path = Path(path)
    try:
        with path.open("rb") as handle:
            raw = handle.read(MAX_SPEC_BYTES + 1)
    except OSError as exc:
        raise SpecError([f"cannot read spec file: {exc.strerror}"], str(path)) from None
    if len(raw) > MAX_SPEC_BYTES:
        raise SpecError(
            [f"spec file is larger than {MAX_SPEC_BYTES} bytes; a spec is a few short lines"],
            str(path),
        )
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise SpecError(
            [f"not UTF-8 text: byte 0x{raw[exc.start]:02x} at line {line}; save the file as UTF-8"],
            str(path),
        ) from None
    try:
        data = copy.deepcopy(_parsed_spec_text(text))  # the caller may change its copy
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}: " if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise SpecError([f"invalid YAML: {where}{problem}"], str(path)) from None
    return data


def spec_json_schema() -> dict[str, Any]:
    """JSON Schema of a spec file, for editors: the field validators' per-field rules (enums,
    ranges, multiples, patterns); rules that tie fields together (e.g. mma_sync's block_m) are
    the validator's alone."""
    schema = KernelSpec.model_json_schema()
    schema["title"] = "kernelgen kernel spec"
    for name, rules in _field_rules().items():
        prop = schema["properties"][name]
        for choice in prop.get("anyOf", [prop]):  # an optional field: its non-null branch
            if choice.get("type") != "null":
                choice.update(rules)
    return schema


def _field_rules() -> dict[str, dict[str, Any]]:
    """JSON Schema keywords per field, from the tables the validators use."""
    from kernelgen.specs.expressions import INPUT_DTYPES, MAX_EXPRESSION_CHARS, MAX_INPUTS, MAX_RANK

    signature = (
        r"^\s*[A-Za-z][A-Za-z0-9_]{0,31}\s*:\s*(" + "|".join(INPUT_DTYPES) + r")"
        rf"\s*\[\s*0*[1-{MAX_RANK}]\s*\]\s*$"
    )
    expression = {"maxLength": MAX_EXPRESSION_CHARS}
    return {
        "head_dim": {"minimum": 8, "maximum": MAX_HEAD_DIM, "multipleOf": 8},
        "block_m": {"minimum": TILE_STEP, "maximum": MAX_BLOCK_M, "multipleOf": TILE_STEP},
        "block_n": {"minimum": TILE_STEP, "maximum": WGMMA_MAX_BLOCK_N, "multipleOf": TILE_STEP},
        "num_warps": {"enum": list(WARP_COUNTS)},
        "stages": {"enum": sorted({1, *MMA_STAGES})},
        "smem_pad": {"minimum": 0, "maximum": 8},
        "score_mod": expression,
        "mask_mod": expression,
        "mod_inputs": {"items": {"type": "string", "pattern": signature}, "maxItems": MAX_INPUTS},
        "archs": {"items": {"type": "string", "enum": list(ARCHS)}, "minItems": 1},
    }


@functools.lru_cache(maxsize=256)
def _with_additive_mask(spec: KernelSpec) -> KernelSpec:
    return KernelSpec(**{**spec.model_dump(), "additive_mask": True})
