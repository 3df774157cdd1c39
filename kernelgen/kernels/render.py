"""Render a spec into CUDA source with Jinja2. C++ spellings live in the tables below."""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from functools import cache
from importlib import resources
from pathlib import Path

import jinja2

from kernelgen.errors import SettingError
from kernelgen.kernels.expression_cuda import (
    expression_source,
    headers,
    input_params,
    input_struct_init,
)
from kernelgen.specs.forward import KernelSpec
from kernelgen.version import __version__

# Render from another copy of templates/ (e.g. an older commit's, to time two versions of a
# kernel on one machine). Read once per process; the folder's hash keys every cache as usual.
TEMPLATE_DIR_ENV = "KERNELGEN_TEMPLATE_DIR"
# The template each kernel family renders from: (mma, loop order) -> file. The tensor-core path
# is v2 only (the spec enforces it).
ENTRY_TEMPLATE = {
    ("simt", "v1"): "fa_fwd_v1.cu.j2",
    ("simt", "v2"): "fa_fwd_v2.cu.j2",
    ("mma_sync", "v2"): "fa_fwd_v2_tc.cu.j2",
    ("wgmma", "v2"): "fa_fwd_wgmma.cu.j2",
}
# The tensor-map parameter type of TMA kernels (the driver's CUtensorMap, 128 opaque bytes).
TENSOR_MAP_CTYPE = "const __grid_constant__ CUtensorMap"
# setmaxnreg budgets of the wgmma kernels (registers per thread; multiples of 8 from 24 to 256):
# the producer keeps what issuing copies needs, the consumers share the rest of the 64K register
# file (512 per thread of one warpgroup), at most 240 each.
PRODUCER_REGS = 24
# Paged K/V: pages that are no multiple of block_n are copied row by row with cp.async by all
# producer threads (each row's page from the block table, 64-bit addresses): ptxas spills below
# 56 there (docs/hopper.md, "Decode and serving").
PAGED_PRODUCER_REGS = 56
# fp8 with V transposed in the kernel (fp8_v_layout: kernel): warps 1-3 of the producer hold a
# 16-key x 4-column block of V and its transpose (transpose_v_tile); ptxas spills below this.
TRANSPOSE_PRODUCER_REGS = 56
# Both (an fp8 paged spec): the same threads copy rows and transpose V; ptxas spills below 80 at
# d128 with 128-key tiles (below 72 with 64-key tiles).
PAGED_TRANSPOSE_PRODUCER_REGS = 80
MAX_CONSUMER_REGS = 240


@dataclass(frozen=True)
class CxxElement:
    """How one element type is spelled in CUDA C++."""

    name: str  # the C++ type
    header: str | None  # header that declares it
    to_float: str  # conversion to fp32 (empty: already float)
    from_float: str  # round-to-nearest-even conversion from fp32
    mma_type: str | None = None  # PTX operand type of mma.sync (None: no tensor-core path)
    pair_name: str | None = None  # the two-element vector type
    pack_pair: str | None = None  # two fp32 -> one pair, round to nearest even


CXX_ELEMENT: dict[str, CxxElement] = {
    "float32": CxxElement("float", None, "", ""),
    "float16": CxxElement(
        "__half",
        "cuda_fp16.h",
        "__half2float",
        "__float2half_rn",
        mma_type="f16",
        pair_name="__half2",
        pack_pair="__floats2half2_rn",
    ),
    "bfloat16": CxxElement(
        "__nv_bfloat16",
        "cuda_bf16.h",
        "__bfloat162float",
        "__float2bfloat16_rn",
        mma_type="bf16",
        pair_name="__nv_bfloat162",
        pack_pair="__floats2bfloat162_rn",
    ),
}


@dataclass(frozen=True)
class WgmmaOperand:
    """How the wgmma kernels spell one operand type (q, k, v and P)."""

    mma_type: str  # PTX operand type of wgmma.mma_async
    k: int  # the k of one product (m64nNk16, m64nNk32): 32 bytes of every operand row
    transposes: bool  # the instruction takes imm-trans-a/b (16-bit); fp8 operands are K-major
    storage: str  # C++ type of one element as read from global memory (the paged row copies)


WGMMA_OPERAND: dict[str, WgmmaOperand] = {
    "float16": WgmmaOperand("f16", 16, True, "__half"),
    "bfloat16": WgmmaOperand("bf16", 16, True, "__nv_bfloat16"),
    "float8_e4m3": WgmmaOperand("e4m3", 32, False, "unsigned char"),  # e4m3 bytes, copied as is
}
# A swizzled tile row's bytes (its swizzle span) -> the descriptor's swizzle mode constant
# (templates/hopper.cuh.j2): wgmma reads each tile in the layout TMA wrote it.
DESC_SWIZZLE: dict[int, str] = {128: "DESC_SWIZZLE_128B", 64: "DESC_SWIZZLE_64B"}


# make_variant's arguments (templates/variants.cuh.j2): the kernel's parameters where the spec
# has the variant, else the values that turn it off.
VARIANT_ARGS: dict[str, tuple[str, str]] = {
    "window": ("window_left, window_right", "-1, -1"),
    "softcap": ("softcap", "0.f"),
}


def variant_args(spec: KernelSpec) -> str:
    """The C++ argument list of make_variant for ``spec`` (with user expressions also the batch
    entry ``b`` and the struct of their inputs, built by :func:`mod_inputs_init`)."""
    args = [on if getattr(spec, name) else off for name, (on, off) in VARIANT_ARGS.items()]
    if spec.has_expressions:
        args += [BATCH_ENTRY_VARIABLE, MOD_INPUTS_VARIABLE]
    return ", ".join(args)


BATCH_ENTRY_VARIABLE = "b"  # every kernel body's batch entry
MOD_INPUTS_VARIABLE = "mod_inputs"


def mod_inputs_init(spec: KernelSpec) -> str:
    """C++ statements building the expressions' input struct from the kernel parameters (empty
    for a spec without expressions)."""
    if not spec.has_expressions:
        return ""
    return input_struct_init(spec.declared_inputs, MOD_INPUTS_VARIABLE)


COMBINE_WARPS = 4  # warps of a split-KV combine block, which combines one (batch, head, query) row
MAX_SPLITS = 128  # key chunks of a split-KV launch; the combine's lanes hold MAX_SPLITS / 32 each


@dataclass(frozen=True)
class Param:
    """One kernel parameter; ``launch`` packs arguments in this order."""

    name: str
    ctype: str


# A block-sparse kernel's block mask (kernelgen.block_mask): the four lists, then the strides of
# its (batch, heads) axes in query-tile rows (0 where the mask broadcasts).
BLOCK_MASK_PARAMS = (
    Param("block_partial_counts", "const int*"),
    Param("block_partial_indices", "const int*"),
    Param("block_full_counts", "const int*"),
    Param("block_full_indices", "const int*"),
    Param("block_mask_stride_b", "long long"),
    Param("block_mask_stride_h", "long long"),
)


def _strides(tensor: str, axes: str) -> list[Param]:
    return [Param(f"{tensor}_stride_{axis}", "long long") for axis in axes]


def kernel_params(spec: KernelSpec) -> tuple[Param, ...]:
    """The main kernel's parameter list (the contract between render and launch).

    A split-KV kernel writes fp32 partials (o_partial, lse_partial) instead of out and lse;
    ``seqlens_k`` (per-sequence key lengths, or null) clamps ``seqlen_k`` for each batch entry.
    A paged-KV kernel also takes ``block_table`` (B, pages per sequence), its row stride and
    ``page_size``; its k/v batch stride is then the stride between pages. A paged wgmma kernel
    takes k and v with their strides beside the maps (pages that are no multiple of block_n
    are copied row by row with cp.async: docs/hopper.md)."""
    elem = CXX_ELEMENT[spec.out_dtype].name
    if spec.engine.warp_specialized:  # q, k and v reach the kernel as TMA tensor maps
        params = [Param(f"{name}_map", TENSOR_MAP_CTYPE) for name in "qkv"]
        if spec.epilogue == "tma":  # out written by TMA stores (out and its strides stay)
            params.append(Param("out_map", TENSOR_MAP_CTYPE))
        # pages of any size: rows copied by cp.async from the pools, in the input type
        if spec.paged_kv:
            pool = WGMMA_OPERAND[spec.dtype].storage
            params += [Param("k", f"const {pool}*"), Param("v", f"const {pool}*")]
    else:
        params = [
            Param("q", f"const {elem}*"),
            Param("k", f"const {elem}*"),
            Param("v", f"const {elem}*"),
        ]
    if spec.split_kv:
        params += [Param("o_partial", "float*"), Param("lse_partial", "float*")]
    else:
        params += [Param("out", f"{elem}*"), Param("lse", "float*")]
    params += [Param("mask", "const float*"), Param("seqlens_k", "const int*")]
    if spec.paged_kv:
        params.append(Param("block_table", "const int*"))
    if spec.loop_order == "v1":
        params.append(Param("workspace", "float*"))
    names = ["batch", "num_heads", "num_kv_heads", "seqlen_q", "max_seqlen_k"]
    names += ["num_splits"] if spec.split_kv else []
    names += ["page_size"] if spec.paged_kv else []
    params += [Param(name, "int") for name in names]
    if not spec.engine.warp_specialized:  # the tensor maps hold the strides of q, k and v
        params += _strides("q", "bhs") + _strides("k", "bhs") + _strides("v", "bhs")
    elif spec.paged_kv:  # (page, head, row) strides of the pools, for the cp.async copies
        params += _strides("k", "bhs") + _strides("v", "bhs")
    if spec.paged_kv:
        params += _strides("block_table", "b")
    if not spec.split_kv:
        params += _strides("out", "bhs")
    params += _strides("mask", "bhqk")
    params.append(Param("scale_log2", "float"))
    if spec.fp8:  # per (batch, kv head) fp32 factors of the fp8 q, k and v (null: 1)
        params += [Param(f"{name}_descale", "const float*") for name in "qkv"]
    for name in spec.variants:
        if not (name == "sinks" and spec.split_kv):  # split-KV: the combine adds the sinks
            params += VARIANT_PARAMS[name]
    params += [Param(name, ctype) for ctype, name in input_params(spec.declared_inputs)]
    if spec.block_sparse:
        params += BLOCK_MASK_PARAMS
    return tuple(params)


# The run-time values of each built-in variant (docs/variants.md), appended to the main kernel's
# parameters when the spec has the variant: a kernel without variants keeps its parameter list.
VARIANT_PARAMS: dict[str, tuple[Param, ...]] = {
    "window": (Param("window_left", "int"), Param("window_right", "int")),
    "softcap": (Param("softcap", "float"),),
    "alibi": (Param("alibi_slopes", "const float*"), Param("alibi_stride_b", "long long")),
    "sinks": (Param("sinks", "const float*"),),
}
# The value of each scalar parameter above that turns its variant off: what a kernel compiled
# with the variant receives from a call without it (a window kernel serves calls without a
# window: unbounded on both sides).
VARIANT_OFF: dict[str, int | float] = {
    "window_left": -1,
    "window_right": -1,
    "softcap": 0.0,
    "alibi_stride_b": 0,
}


def combine_params(spec: KernelSpec) -> tuple[Param, ...]:
    """Parameters of a split-KV spec's combine kernel: partials in, out (in the
    spec's output type) and lse out."""
    elem = CXX_ELEMENT[spec.out_dtype].name  # fp8: bf16
    params = [
        Param("o_partial", "const float*"),
        Param("lse_partial", "const float*"),
        Param("out", f"{elem}*"),
        Param("lse", "float*"),
    ]
    params += [Param(name, "int") for name in ("batch", "num_heads", "seqlen_q", "num_splits")]
    params += _strides("out", "bhs")
    if spec.sinks:  # the combine adds each row's sink once, after the chunks
        params.append(Param("sinks", "const float*"))
    return tuple(params)


def consumer_registers(spec: KernelSpec) -> int:
    """setmaxnreg budget of a wgmma consumer thread: the register file (64K, i.e. 512 per thread
    of one warpgroup) less the producer's, shared by the consumers, in multiples of 8, at most
    :data:`MAX_CONSUMER_REGS`."""
    share = (512 - producer_registers(spec)) // max(1, spec.consumer_warpgroups)
    return min(MAX_CONSUMER_REGS, share // 8 * 8)


def producer_registers(spec: KernelSpec) -> int:
    """setmaxnreg budget of a wgmma producer thread: :data:`PRODUCER_REGS`, with paged K/V
    :data:`PAGED_PRODUCER_REGS` (its cp.async row copies), with V transposed in the kernel
    :data:`TRANSPOSE_PRODUCER_REGS`, with both :data:`PAGED_TRANSPOSE_PRODUCER_REGS`."""
    if spec.paged_kv and spec.v_transposed_in_kernel:
        return PAGED_TRANSPOSE_PRODUCER_REGS
    if spec.paged_kv:
        return PAGED_PRODUCER_REGS
    return TRANSPOSE_PRODUCER_REGS if spec.v_transposed_in_kernel else PRODUCER_REGS


def workspace_floats(spec: KernelSpec, batch: int, num_heads: int, seqlen_q: int) -> int:
    """fp32 scratch a launch needs: v1 keeps (o, m, l) of every query row in global memory."""
    if spec.loop_order != "v1":
        return 0
    return batch * num_heads * seqlen_q * (spec.head_dim + 2)


@cache
def environment() -> jinja2.Environment:
    """The Jinja environment of the templates folder (every family renders through it)."""
    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(template_dir())),
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
        autoescape=False,
    )


@cache
def template_dir() -> Path:
    """The templates' folder: $KERNELGEN_TEMPLATE_DIR when set, else the installed package's
    own, else (a source checkout on PYTHONPATH, not installed) the checkout's templates/."""
    override = os.environ.get(TEMPLATE_DIR_ENV)
    if not override:
        try:
            return Path(str(resources.files("kernelgen.templates")))
        except ModuleNotFoundError:
            # this file is kernelgen/kernels/render.py: the checkout is two folders up
            return Path(__file__).resolve().parents[2] / "templates"
    folder = Path(override).expanduser()
    missing = [name for name in ENTRY_TEMPLATE.values() if not (folder / name).is_file()]
    if missing:
        raise SettingError(
            f"{TEMPLATE_DIR_ENV}={override!r}: not a templates folder (missing "
            f"{', '.join(missing)}); unset it or point it at a copy of kernelgen's templates/"
        )
    return folder


@cache
def template_hash() -> str:
    """sha256 over every template file: part of every cache key."""
    return folder_hash(template_dir())


def folder_hash(folder: Path) -> str:
    """sha256 over every template file (name and bytes) of ``folder``, read afresh."""
    digest = hashlib.sha256()
    for path in sorted(folder.glob("*.j2")):
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def template_name(spec: KernelSpec) -> str:
    return ENTRY_TEMPLATE[spec.mma, spec.loop_order]


VARIANT_PIECE = "variants.cuh.j2"  # the shared template piece of the attention variants


def render(spec: KernelSpec) -> str:
    """CUDA source of the spec's kernel, named by its URI. A spec with variants needs templates
    that have them (an older templates folder would silently leave them out)."""
    if spec.variants and not (template_dir() / VARIANT_PIECE).is_file():
        raise SettingError(
            f"{spec.uri}: the templates in {template_dir()} predate the attention variants (no "
            f"{VARIANT_PIECE}); use kernelgen's own templates for a spec with "
            f"{', '.join(spec.variants)}"
        )
    template = environment().get_template(template_name(spec))
    return template.render(
        spec=spec,
        uri=spec.uri,
        engine=spec.engine.description,
        producer_regs=producer_registers(spec),
        consumer_regs=consumer_registers(spec) if spec.engine.warp_specialized else 0,
        elem=CXX_ELEMENT[spec.out_dtype],
        operand=WGMMA_OPERAND.get(spec.dtype),
        desc_swizzle=DESC_SWIZZLE,
        params=kernel_params(spec),
        combine_params=combine_params(spec) if spec.split_kv else (),
        combine_uri=spec.combine_uri,
        variant_args=variant_args(spec),
        mod_inputs_init=mod_inputs_init(spec),
        mod_headers=headers(spec.declared_inputs),
        expression_source=expression_source(*spec.expressions) if spec.has_expressions else "",
        combine_warps=COMBINE_WARPS,
        max_splits=MAX_SPLITS,
        spec_yaml=spec.to_yaml().rstrip("\n").splitlines(),
        generator_version=__version__,
        template_hash=template_hash()[:16],
    )


def render_template(template: str, **context: object) -> str:
    """Render template file ``template`` of the templates folder with ``context`` (kernels other
    than a spec's attention kernels, e.g. the block-mask builder)."""
    try:
        loaded = environment().get_template(template)
    except jinja2.TemplateNotFound:
        raise SettingError(
            f"the templates folder {template_dir()} has no {template}; point "
            f"{TEMPLATE_DIR_ENV} at a copy of this kernelgen's templates/ or unset it"
        ) from None
    return loaded.render(**context)
