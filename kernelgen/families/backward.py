"""The backward family: its kernels' parameters, launch plan, scratch buffers and rendering.

One backward spec (:class:`~kernelgen.specs.backward.BackwardSpec`) renders to one CUDA
source holding three kernels, launched in order (docs/backward.md):

1. ``{uri}_pre``: D = rowsum(dout * out) in fp32 (and the fp32 dq accumulator zeroed);
2. ``{uri}``: a block per (key tile, batch, key/value head) recomputes P and dS and sums dK, dV;
3. ``{uri}_dq`` (deterministic: dQ per query tile, no atomics) or ``{uri}_dq_convert`` (dq from
   the accumulator the main kernel added to with atomics).

The parameter lists here are the contract between the template and every launcher (CuPy and the
emulator take the same :class:`~kernelgen.runtime.launch.LaunchStep` list).
"""

from __future__ import annotations

import math

from kernelgen.errors import InputError
from kernelgen.kernels.expression_cuda import (
    expression_source,
    headers,
    input_params,
    score_mod_grad_source,
)
from kernelgen.kernels.render import (
    CXX_ELEMENT,
    VARIANT_PARAMS,
    Param,
    environment,
    mod_inputs_init,
    template_hash,
    variant_args,
)
from kernelgen.runtime.launch import MAX_GRID, Grid, LaunchStep, Problem
from kernelgen.specs.backward import BackwardSpec
from kernelgen.specs.engines import engine_of
from kernelgen.version import __version__

ENTRY_TEMPLATE = {"simt": "fa_bwd_simt.cu.j2", "mma_sync": "fa_bwd_tc.cu.j2"}
# Parameter prefixes of a block-sparse spec's tile lists (kernelgen.calls.backward_mask): the main
# kernel's query tiles per key tile, the dQ kernel's key tiles per query tile (a block mask's,
# named as the forward names them).
QUERY_LISTS = "query"
KEY_LISTS = "block"
# The tensors of a backward call, by parameter name, in the order (b, h, s) of their strides.
STRIDED_TENSORS = ("q", "k", "v", "out", "dout", "dq", "dk", "dv")


def _strides(tensor: str) -> list[Param]:
    return [Param(f"{tensor}_stride_{axis}", "long long") for axis in "bhs"]


def _mask_strides() -> list[Param]:
    return [Param(f"mask_stride_{axis}", "long long") for axis in "bhqk"]


def _variant_params(spec: BackwardSpec) -> list[Param]:
    """The built-in variants' run-time values (sinks have none here: dsinks is the caller's)."""
    return [p for name in spec.variants if name != "sinks" for p in VARIANT_PARAMS[name]]


def _recompute_params(spec: BackwardSpec) -> list[Param]:
    """What a kernel that recomputes the scores reads after its tensors: sizes, strides of q, k,
    v and dout, the mask's, the scale and the variants' and expressions' values."""
    params = [Param("mask", "const float*")]
    names = ("batch", "num_heads", "num_kv_heads", "seqlen_q", "max_seqlen_k")
    params += [Param(name, "int") for name in names]
    for tensor in ("q", "k", "v", "dout"):
        params += _strides(tensor)
    params += _mask_strides()
    params.append(Param("scale_log2", "float"))
    params += _variant_params(spec)
    params += [Param(name, ctype) for ctype, name in input_params(spec.declared_inputs)]
    return params


def _list_params(prefix: str) -> list[Param]:
    """A block-sparse kernel's tile lists (kernelgen.calls.backward_mask): counts and indices of the
    partly and fully visible tiles, and the lists' (batch, head) strides in rows."""
    params = [
        Param(f"{prefix}_{name}", "const int*")
        for name in ("partial_counts", "partial_indices", "full_counts", "full_indices")
    ]
    return params + [Param(f"{prefix}_mask_stride_{axis}", "long long") for axis in "bh"]


def _inputs(spec: BackwardSpec) -> list[Param]:
    elem = CXX_ELEMENT[spec.dtype].name
    return [Param(name, f"const {elem}*") for name in ("q", "k", "v", "dout")] + [
        Param("lse", "const float*"),
        Param("delta", "const float*"),
    ]


def main_params(spec: BackwardSpec) -> tuple[Param, ...]:
    """Parameters of the main kernel (dK, dV; with atomics also dQ's accumulator)."""
    elem = CXX_ELEMENT[spec.dtype].name
    params = _inputs(spec)
    if not spec.deterministic:
        params.append(Param("dq_accum", "float*"))
    params += [Param("dk", f"{elem}*"), Param("dv", f"{elem}*")]
    params += _recompute_params(spec)
    params += _strides("dk") + _strides("dv")
    if spec.block_sparse:  # per key tile, the query tiles to visit
        params += _list_params(QUERY_LISTS)
    return tuple(params)


def dq_params(spec: BackwardSpec) -> tuple[Param, ...]:
    """Parameters of the deterministic dQ kernel."""
    elem = CXX_ELEMENT[spec.dtype].name
    params = [*_inputs(spec), Param("dq", f"{elem}*"), *_recompute_params(spec)]
    params += _strides("dq")
    if spec.block_sparse:  # per query tile, the key tiles to visit
        params += _list_params(KEY_LISTS)
    return tuple(params)


def pre_params(spec: BackwardSpec) -> tuple[Param, ...]:
    """Parameters of the preprocess kernel (D, and the accumulator's zeroing)."""
    elem = CXX_ELEMENT[spec.dtype].name
    params = [
        Param("out", f"const {elem}*"),
        Param("dout", f"const {elem}*"),
        Param("delta", "float*"),
    ]
    if not spec.deterministic:
        params.append(Param("dq_accum", "float*"))
    params += [Param(name, "int") for name in ("batch", "num_heads", "seqlen_q")]
    return tuple(params + _strides("out") + _strides("dout"))


def convert_params(spec: BackwardSpec) -> tuple[Param, ...]:
    """Parameters of the dq conversion kernel (atomic dQ only)."""
    elem = CXX_ELEMENT[spec.dtype].name
    params = [Param("dq_accum", "const float*"), Param("dq", f"{elem}*")]
    params += [Param(name, "int") for name in ("batch", "num_heads", "seqlen_q")]
    return tuple(params + _strides("dq"))


def _checked_grid(spec: BackwardSpec, blocks: int) -> Grid:
    if blocks > MAX_GRID[0]:
        raise InputError(
            f"{spec.uri}: the call needs {blocks} blocks, over CUDA's limit of {MAX_GRID[0]}; "
            "split the call over the batch"
        )
    return (max(1, blocks), 1, 1)


def launch_steps(spec: BackwardSpec, problem: Problem) -> list[LaunchStep]:
    """The launches of one backward call, in order."""
    rows = problem.batch * problem.num_heads * problem.seqlen_q
    warps = spec.num_warps
    row_grid = _checked_grid(spec, math.ceil(rows / warps))
    block = (spec.threads, 1, 1)
    key_tiles = math.ceil(problem.seqlen_k / spec.block_n)
    main_grid = _checked_grid(spec, key_tiles * problem.batch * problem.num_kv_heads)
    steps = [
        LaunchStep(f"{spec.uri}_pre", pre_params(spec), row_grid, block, 0),
        LaunchStep(spec.uri, main_params(spec), main_grid, block, spec.smem_bytes),
    ]
    if spec.deterministic:
        query_tiles = math.ceil(problem.seqlen_q / spec.dq_block_m)
        grid = _checked_grid(spec, query_tiles * problem.batch * problem.num_heads)
        dq_block = (spec.dq_threads, 1, 1)
        dq_step = LaunchStep(f"{spec.uri}_dq", dq_params(spec), grid, dq_block, spec.dq_smem_bytes)
        steps.append(dq_step)
    else:
        steps.append(LaunchStep(f"{spec.uri}_dq_convert", convert_params(spec), row_grid, block, 0))
    return steps


def symbols(spec: BackwardSpec) -> list[str]:
    """The kernels' extern "C" names, in launch order."""
    tail = "_dq" if spec.deterministic else "_dq_convert"
    return [f"{spec.uri}_pre", spec.uri, f"{spec.uri}{tail}"]


def scratch_floats(spec: BackwardSpec, problem: Problem) -> dict[str, int]:
    """fp32 scratch by parameter name: D per query row and, with atomics, the dq accumulator."""
    rows = problem.batch * problem.num_heads * problem.seqlen_q
    buffers = {"delta": rows}
    if not spec.deterministic:
        buffers["dq_accum"] = rows * spec.head_dim
    return buffers


def render(spec: BackwardSpec) -> str:
    """CUDA source of the spec's kernels, named by its URI."""
    score_mod, mask_mod = spec.expressions
    sources = [expression_source(score_mod, mask_mod)] if spec.has_expressions else []
    if score_mod is not None:
        sources.append(score_mod_grad_source(score_mod))
    template = environment().get_template(ENTRY_TEMPLATE[spec.mma])
    return template.render(
        spec=spec,
        uri=spec.uri,
        engine=engine_of(spec).description,
        elem=CXX_ELEMENT[spec.dtype],
        params=main_params(spec),
        pre_params=pre_params(spec),
        dq_params=dq_params(spec),
        convert_params=convert_params(spec),
        variant_args=variant_args(spec),
        mod_inputs_init=mod_inputs_init(spec),
        mod_headers=headers(spec.declared_inputs),
        expression_source="\n".join(sources),
        spec_yaml=spec.to_yaml().rstrip("\n").splitlines(),
        generator_version=__version__,
        template_hash=template_hash()[:16],
    )
