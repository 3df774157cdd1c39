"""The backward family's spec: a frozen Pydantic model of one attention backward kernel set.

A backward spec fixes everything that is a compile-time constant of the kernels that compute
dQ, dK and dV from dO (docs/backward.md): the engine (CUDA cores, or mma.sync tensor cores with
their warp roles and cp.async stages), dtype, head dim, tiling, the mask and the variants
compiled in, and how dQ is accumulated. Its ``uri`` names the kernels, the file
under generated/ and every cache entry, as a forward spec's does.
"""

from __future__ import annotations

import functools
import json
import math
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    field_validator,
    model_serializer,
    model_validator,
)

from kernelgen.specs.arch import ARCHS, DEFAULT_ARCHS
from kernelgen.specs.engines import ENGINES, Engine
from kernelgen.specs.expressions import Expression, ModInput, spec_expressions
from kernelgen.specs.forward import (
    DTYPE_BYTES,
    DTYPE_SHORT,
    EXPRESSION_FIELDS,
    EXPRESSION_TAGS,
    MAX_ACCUMULATORS_PER_THREAD,
    VARIANT_FLAGS,
    VARIANT_TAGS,
    DType,
    canonical_expression_fields,
    checked_archs,
    checked_head_dim,
    padded_head_dim,
    strict_boolean,
    strict_integer,
)

BackwardEngine = Literal["simt", "mma_sync"]
# Tiles of the CUDA-core backward: a block owns BLOCK_N keys and walks BLOCK_M queries at a time.
BACKWARD_TILES = (16, 32, 64)
BACKWARD_WARPS = (1, 2, 4, 8)
# Words of padding after each shared-memory row of Q, K, V and dO: an odd row stride in words,
# so the rows a warp reads at one column fall in different banks.
BACKWARD_SMEM_PAD_WORDS = 1
# The tensor-core backward (templates/fa_bwd_tc.cu.j2): tiles are whole m16/k16 steps.
TC_TILES = (16, 32, 64, 128)
TC_STAGES = (1, 2)  # Q/dO tiles in flight (1: no prefetch, for the widest heads on sm_80)
TC_DTYPES = ("float16", "bfloat16")
# fp32 registers a thread may hold for its dK and dV rows and, beside them, for its share of the
# S^T and dP^T tiles (ptxas keeps 255 registers: the rest is fragments, addresses and the loop).
TC_MAX_KV_ACCUMULATORS = 128
TC_MAX_ACCUMULATORS = 192
# The deterministic dQ kernel of the tensor-core engine: 4 warps of 16 query rows each; key
# tiles of 64 (32 above head dim 128, where a warp's dQ rows take 128 registers).
TC_DQ_WARPS = 4
TC_DQ_STAGES = 2
TC_SWIZZLE_GROUP = 64  # elements: shared-memory rows are whole groups of 8 swizzled chunks
TC_WARP_QUERIES = (16, 32)  # query columns of a warp's S^T tile (its 8- or 16-byte stores)


class BackwardSpec(BaseModel):
    """Kernels of one FlashAttention backward pass (preprocess, main, dQ), fully determined."""

    model_config = ConfigDict(frozen=True, extra="forbid", validate_default=True)

    family: Literal["backward"] = Field(
        description="The kernel family: 'backward' (dQ, dK, dV of attention)."
    )
    mma: BackwardEngine = Field(
        "simt",
        description="The engine: simt (fp32 FMA on CUDA cores, every dtype; the readable "
        "reference family) or mma_sync (tensor cores, float16/bfloat16, sm_80+: ldmatrix, "
        "cp.async, fp32 accumulation).",
    )
    dtype: DType = Field(description="Element type of q, k, v, out, dout and the gradients.")
    head_dim: int = Field(description="Head dimension D: a multiple of 8, at most 256.")
    block_m: int = Field(
        32, description="Query rows per tile a block walks: 16, 32 or 64 (mma_sync: up to 128)."
    )
    block_n: int = Field(
        32, description="Keys a block owns (its dK, dV rows): 16, 32 or 64 (mma_sync: up to 128)."
    )
    num_warps: int = Field(4, description="Warps per thread block: 1, 2, 4 or 8.")
    stages: int | None = Field(
        None,
        description="mma_sync only: query tiles (Q and dO) in flight in the cp.async ring, 1 or "
        "2 (default 2; 1 loads each tile after the previous one is done).",
    )
    split_roles: bool = Field(
        False,
        description="mma_sync only: half the warps compute S^T and P^T and sum dV, the other "
        "half dP^T and dS^T and sum dK, each over the whole query tile with P^T or dS^T kept in "
        "registers (less shared-memory traffic; block_n = 16 x num_warps, block_m 32 or 64, "
        "head dims up to 128, no softcap or score_mod).",
    )
    causal: bool = Field(False, description="Bottom-right aligned causal mask.")
    deterministic: bool = Field(
        False,
        description="dQ without atomics: a separate kernel per query tile sums its key tiles in "
        "a fixed order, so dQ, dK and dV are bitwise the same on every run (about one more "
        "recomputation of the scores). Off: dQ is accumulated with fp32 atomics.",
    )
    additive_mask: bool = Field(False, description="The kernels read an additive mask.")
    window: bool = Field(False, description="Sliding window (bounds are run-time arguments).")
    softcap: bool = Field(False, description="Score soft-capping s <- c tanh(s / c).")
    alibi: bool = Field(False, description="ALiBi slopes (a run-time fp32 array).")
    sinks: bool = Field(False, description="Per-head sink logits (their gradient is dsinks).")
    score_mod: str | None = Field(
        None, description="A user score expression; its derivative is compiled in."
    )
    mask_mod: str | None = Field(None, description="A user mask expression.")
    mod_inputs: tuple[str, ...] = Field((), description="Arrays the expressions read.")
    block_sparse: bool = Field(
        False,
        description="Visit only the tiles a block mask of the mask_mod lists (the main kernel: "
        "per key tile its partly and fully visible query tiles; the dQ kernel: per query tile "
        "its key tiles), skipping the mask_mod on fully visible tiles.",
    )
    archs: tuple[str, ...] = Field(DEFAULT_ARCHS, description="GPU architectures it must fit.")

    @model_serializer(mode="wrap")
    def _drop_defaults_that_are_off(self, handler: Any) -> dict[str, Any]:
        """Flags that are off and absent expressions are left out of dumps, as in forward specs."""
        data = handler(self)
        for name in (
            *VARIANT_FLAGS,
            "additive_mask",
            "deterministic",
            "block_sparse",
            "split_roles",
        ):
            if data.get(name) is False:
                del data[name]
        if data.get("stages") is None:  # the CUDA-core engine has no stages
            data.pop("stages", None)
        for name in EXPRESSION_FIELDS:
            if data.get(name) is None:
                del data[name]
        if not data.get("mod_inputs"):
            data.pop("mod_inputs", None)
        return data

    @model_validator(mode="before")
    @classmethod
    def _canonical_expressions(cls, data: Any) -> Any:
        """score_mod and mask_mod in canonical form, checked against mod_inputs."""
        return canonical_expression_fields(data)

    @model_validator(mode="before")
    @classmethod
    def _engine_defaults(cls, data: Any) -> Any:
        """Tensor-core engines: their default stages unless given."""
        if not isinstance(data, dict) or data.get("stages") is not None:
            return data
        mma = data.get("mma", "simt")
        engine = ENGINES.get(mma) if isinstance(mma, str) else None  # else: the field's error
        if engine is not None and engine.tensor_cores:
            data = {**data, "stages": engine.default_stages}
        return data

    @field_validator("head_dim", "block_m", "block_n", "num_warps", "stages", mode="before")
    @classmethod
    def _strict_integer(cls, value: Any, info: Any) -> Any:
        if value is None and info.field_name == "stages":
            return None
        return strict_integer(info.field_name, value)

    @field_validator(
        "causal",
        "deterministic",
        "additive_mask",
        "block_sparse",
        "split_roles",
        *VARIANT_FLAGS,
        mode="before",
    )
    @classmethod
    def _strict_boolean(cls, value: Any, info: Any) -> Any:
        return strict_boolean(info.field_name, value)

    @field_validator("head_dim")
    @classmethod
    def _check_head_dim(cls, value: int) -> int:
        return checked_head_dim(value)

    @field_validator("block_m", "block_n")
    @classmethod
    def _check_tile(cls, value: int, info: Any) -> int:
        mma = info.data.get("mma")
        tc = isinstance(mma, str) and mma in ENGINES and ENGINES[mma].tensor_cores
        allowed = TC_TILES if tc else BACKWARD_TILES
        if value not in allowed:
            engine = " with mma='mma_sync'" if tc else ""
            raise ValueError(
                f"{info.field_name}={value} is not allowed{engine}; use one of "
                f"{', '.join(map(str, allowed))}"
            )
        return value

    @field_validator("num_warps")
    @classmethod
    def _check_num_warps(cls, value: int) -> int:
        if value not in BACKWARD_WARPS:
            raise ValueError(
                f"num_warps={value} is not allowed; use one of "
                f"{', '.join(map(str, BACKWARD_WARPS))}"
            )
        return value

    @field_validator("archs")
    @classmethod
    def _check_archs(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        return checked_archs(value)

    @model_validator(mode="after")
    def _check_geometry(self) -> BackwardSpec:
        problems = []
        if self.mod_inputs and not self.has_expressions:
            problems.append(
                "mod_inputs are declared but the spec has no score_mod or mask_mod; remove them"
            )
        if self.block_sparse and self.mask_mod is None:
            problems.append(
                "block_sparse=true needs a mask_mod (the block mask lists the tiles to visit)"
            )
        if self.engine.tensor_cores:
            problems += self._tc_problems()
        else:
            problems += self._simt_problems()
        if self.split_roles and not problems:
            problems += self._split_problems()
        if problems:  # the geometry below needs the tiling to be consistent
            raise ValueError("\n".join(problems))
        for arch in self.archs:
            if self.smem_bytes > ARCHS[arch].max_smem_per_block:
                problems.append(
                    f"{self.smem_bytes} bytes of shared memory per block, over the "
                    f"{ARCHS[arch].max_smem_per_block} of {arch}; use smaller block_m or block_n"
                    + (" or stages: 1" if self.engine.tensor_cores and self.stages != 1 else "")
                )
            if self.engine.tensor_cores and self.dq_smem_bytes > ARCHS[arch].max_smem_per_block:
                problems.append(
                    f"the dQ kernel's {self.dq_smem_bytes} bytes of shared memory are over the "
                    f"{ARCHS[arch].max_smem_per_block} of {arch}"
                )
        if problems:
            raise ValueError("\n".join(problems))
        return self

    def _simt_problems(self) -> list[str]:
        problems = []
        if self.stages is not None:
            problems.append(
                f"stages={self.stages!r} is not allowed with mma='simt'; leave it out (the "
                "CUDA-core kernels load their tiles synchronously)"
            )
        limit = MAX_ACCUMULATORS_PER_THREAD["simt"]
        if self.accumulators_per_thread > limit:
            problems.append(
                f"block_n={self.block_n} x head_dim={self.head_dim} gives each of "
                f"{self.threads} threads {self.accumulators_per_thread} dK and dV accumulators "
                f"(at most {limit}); use a smaller block_n or more warps"
            )
        return problems

    def _tc_problems(self) -> list[str]:
        """The tensor-core engine's rules (templates/fa_bwd_tc.cu.j2): warps own 16 or 32 keys
        (key_warps of them cover block_n) and split the head dim's columns and the query tile
        dim_warps ways; every share is whole m16/k16 steps."""
        if self.dtype not in TC_DTYPES:
            return [
                f"dtype={self.dtype!r} is not allowed with mma='mma_sync'; use float16 or "
                "bfloat16 (or mma: simt)"
            ]
        if self.stages not in TC_STAGES:
            return [
                f"stages={self.stages} is not allowed with mma='mma_sync'; use one of "
                f"{', '.join(map(str, TC_STAGES))}"
            ]
        if self.num_warps % self.key_warps:
            return [
                f"block_n={self.block_n} needs a multiple of {self.key_warps} warps (each owns "
                f"{self.warp_keys} keys); num_warps={self.num_warps} is not one"
            ]
        problems = []
        if self.warp_queries not in TC_WARP_QUERIES:
            allowed = " or ".join(str(q * self.dim_warps) for q in TC_WARP_QUERIES)
            problems.append(
                f"block_m={self.block_m} is not allowed with block_n={self.block_n} and "
                f"num_warps={self.num_warps}: the {self.dim_warps} warps that share a key range "
                f"split the query tile into 16 or 32 queries each; use block_m={allowed}"
            )
        if self.block_m > 32 * self.num_warps:
            problems.append(
                f"block_m={self.block_m} is over 32 rows per warp for the dQ product; use "
                f"block_m <= {32 * self.num_warps} or more warps"
            )
        if self.kv_accumulators > TC_MAX_KV_ACCUMULATORS:
            problems.append(
                f"head_dim={self.head_dim} with block_n={self.block_n} and num_warps="
                f"{self.num_warps} gives each thread {self.kv_accumulators} dK and dV "
                f"accumulators (at most {TC_MAX_KV_ACCUMULATORS}); use more warps or a smaller "
                "block_n"
            )
        elif self.accumulators_per_thread > TC_MAX_ACCUMULATORS:
            problems.append(
                f"block_m={self.block_m} gives each thread {self.accumulators_per_thread} "
                f"accumulators (dK, dV and its S and dP tiles; at most {TC_MAX_ACCUMULATORS}); "
                "use a smaller block_m"
            )
        return problems

    def _split_problems(self) -> list[str]:
        """split_roles (templates/fa_bwd_tc.cu.j2): two warps per 32-key range, one for S^T,
        P^T, dV and dQ, one for dP^T, dS^T and dK, each over the whole query tile (a warp's dK or
        dV rows span the head dim: the accumulator limit keeps head dims to 128); the dS warps'
        threads load one query row's statistics each, so block_m is at most theirs."""
        if not self.engine.tensor_cores:
            return ["split_roles=True needs mma='mma_sync'"]
        problems = []
        if self.warp_keys != 32 or self.dim_warps != 2:
            problems.append(
                f"split_roles=True needs two warps per 32 keys: block_n={self.block_n} with "
                f"num_warps={self.num_warps} is not that; use block_n={16 * self.num_warps}"
            )
        if self.block_m > self.threads // 2:  # STATS_THREAD0 in templates/fa_bwd_tc.cu.j2
            problems.append(
                f"split_roles=True loads each query row's lse and D with one thread of the dS "
                f"warps: block_m={self.block_m} is over their {self.threads // 2} threads with "
                f"num_warps={self.num_warps}; use block_m={self.threads // 2} or more warps"
            )
        if self.softcap or self.score_mod is not None:
            problems.append(
                "split_roles=True computes dS where the scores are not: softcap and score_mod "
                "(a per-score derivative) are not allowed with it"
            )
        if self.block_sparse:
            problems.append(
                "split_roles=True walks every query tile in its role loops: block_sparse=True "
                "is not allowed with it (use split_roles=False)"
            )
        return problems

    # ---- derived geometry (single source for render, launch and validation) --------------
    @property
    def engine(self) -> Engine:
        """The row of this spec's engine (:mod:`kernelgen.specs.engines`)."""
        return ENGINES[self.mma]

    @property
    def threads(self) -> int:
        return 32 * self.num_warps

    @property
    def elem_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def smem_row_elems(self) -> int:
        """Row stride of the Q, K, V and dO tiles in shared memory, in elements."""
        if self.engine.tensor_cores:  # swizzled: whole groups of 8 chunks
            return _round_up(self.head_dim_padded, TC_SWIZZLE_GROUP)
        return self.head_dim + BACKWARD_SMEM_PAD_WORDS * 4 // self.elem_bytes

    # ---- tensor-core geometry (templates/fa_bwd_tc.cu.j2) --------------------------------
    @property
    def head_dim_padded(self) -> int:
        """Head dim rounded up to the mma k-step of 16 (zero columns in shared memory)."""
        return padded_head_dim(self.head_dim)

    @property
    def warp_keys(self) -> int:
        """Keys of a warp's S^T, dP^T, dK and dV rows: one or two m16 tiles."""
        return 32 if self.block_n >= 32 else 16

    @property
    def key_warps(self) -> int:
        """Warps along the block's keys (each owns warp_keys of them)."""
        return self.block_n // self.warp_keys

    @property
    def dim_warps(self) -> int:
        """Warps that share a key range: they split the query tile of S^T and dP^T, and the head
        dim's columns of dK and dV."""
        return max(1, self.num_warps // self.key_warps)

    @property
    def warp_queries(self) -> int:
        """Queries (columns) of a warp's S^T and dP^T tiles."""
        return self.block_m // self.dim_warps

    @property
    def column_pairs(self) -> int:
        """16-column pairs of n8 tiles of the padded head dim."""
        return self.head_dim_padded // 16

    @property
    def warp_pairs(self) -> int:
        """Column pairs of a warp's dK and dV rows (the last warps may have fewer; with
        split_roles a warp holds dK or dV of every column)."""
        if self.split_roles:
            return self.column_pairs
        return -(-self.column_pairs // self.dim_warps)

    @property
    def dq_warps(self) -> int:
        """Warps that compute dQ in the main kernel (split_roles: the P warps)."""
        return self.num_warps // 2 if self.split_roles else self.num_warps

    @property
    def dq_m_tiles(self) -> int:
        """m16 tiles of a warp's dQ rows (atomic dQ in the main kernel; split_roles: the whole
        query tile)."""
        if self.split_roles:
            return self.block_m // 16
        return 2 if self.block_m >= 32 else 1

    @property
    def dq_row_warps(self) -> int:
        return self.block_m // (16 * self.dq_m_tiles)

    @property
    def dq_col_warps(self) -> int:
        return max(1, self.dq_warps // self.dq_row_warps)

    @property
    def dq_pairs(self) -> int:
        """Column pairs of a warp's dQ tile in the main kernel."""
        return -(-self.column_pairs // self.dq_col_warps)

    @property
    def prob_row_elems(self) -> int:
        """Row stride of the 16-bit P^T and dS^T tiles (keys x queries), in elements: the query
        tile in whole groups of 8 swizzled chunks."""
        return _round_up(self.block_m, TC_SWIZZLE_GROUP)

    @property
    def kv_accumulators(self) -> int:
        """fp32 registers of a thread's dK and dV rows (tensor cores; split_roles: dK or dV)."""
        return self.warp_keys * self.warp_pairs // (2 if self.split_roles else 1)

    @property
    def dq_threads(self) -> int:
        """Threads of the deterministic dQ kernel."""
        return 32 * TC_DQ_WARPS if self.engine.tensor_cores else self.threads

    @property
    def dq_block_m(self) -> int:
        """Query rows of a block of the deterministic dQ kernel."""
        return 16 * TC_DQ_WARPS if self.engine.tensor_cores else self.block_m

    @property
    def dq_block_n(self) -> int:
        """Keys per tile of the deterministic dQ kernel."""
        if not self.engine.tensor_cores:
            return self.block_n
        return 64 if self.head_dim_padded <= 128 else 32

    @property
    def dq_smem_bytes(self) -> int:
        """Dynamic shared memory of the deterministic dQ kernel."""
        if not self.engine.tensor_cores:
            return self.smem_bytes
        rows = 2 * self.dq_block_m + 2 * TC_DQ_STAGES * self.dq_block_n
        return rows * self.smem_row_elems * self.elem_bytes

    @property
    def prob_row_floats(self) -> int:
        """Row stride of the fp32 P and dS tiles (one extra word moves rows to other banks)."""
        return self.block_n + 1

    @property
    def accumulators_per_thread(self) -> int:
        """fp32 registers of a thread's share of the block's dK and dV rows (tensor cores: and
        of its S^T and dP^T tiles)."""
        if self.engine.tensor_cores:  # split_roles: S^T or dP^T over the whole query tile
            return self.kv_accumulators + 2 * self.warp_keys * self.warp_queries // 32
        return 2 * math.ceil(self.block_n * self.head_dim / self.threads)

    @property
    def smem_bytes(self) -> int:
        """Dynamic shared memory of the main kernel (simt: and of the dQ kernel). simt: K, V, Q
        and dO tiles, the fp32 P and dS tiles, the rows' lse and D. mma_sync: the K and V tiles,
        the Q and dO ring, the 16-bit P^T and dS^T tiles and two slots of the rows' lse and
        (twice) D."""
        if self.engine.tensor_cores:
            rows = 2 * self.block_n + 2 * self.stages * self.block_m  # type: ignore[operator]
            tiles = rows * self.smem_row_elems * self.elem_bytes
            probs = 2 * self.block_n * self.prob_row_elems * self.elem_bytes
            return tiles + probs + 2 * 3 * self.block_m * 4  # two slots of lse2 and -D (twice)
        tiles = 2 * (self.block_m + self.block_n) * self.smem_row_elems * self.elem_bytes
        return tiles + 2 * self.block_m * self.prob_row_floats * 4 + 2 * self.block_m * 4

    @property
    def uri(self) -> str:
        """Canonical readable name, e.g. ``fa_bwd_simt_bf16_d128_m32_n32_w4_causal_det`` or
        ``fa_bwd_tc_bf16_d128_m64_n128_w8_s2``."""
        parts = [
            "fa_bwd",
            self.engine.uri_tag or self.mma,
            DTYPE_SHORT[self.dtype],
            f"d{self.head_dim}",
            f"m{self.block_m}",
            f"n{self.block_n}",
            f"w{self.num_warps}",
        ]
        if self.engine.tensor_cores:
            parts.append(f"s{self.stages}")
        if self.split_roles:
            parts.append("split")
        if self.causal:
            parts.append("causal")
        if self.additive_mask:
            parts.append("amask")
        parts += [VARIANT_TAGS[name] for name in VARIANT_FLAGS if getattr(self, name)]
        parts += [f"{EXPRESSION_TAGS[e.kind]}{e.hash}" for e in self.expressions if e is not None]
        if self.block_sparse:
            parts.append("bsparse")
        if self.deterministic:
            parts.append("det")
        return "_".join(parts)

    @property
    def variants(self) -> tuple[str, ...]:
        return tuple(name for name in VARIANT_FLAGS if getattr(self, name))

    @property
    def expressions(self) -> tuple[Expression | None, Expression | None]:
        return _cached_expressions(self.score_mod, self.mask_mod, self.mod_inputs)[:2]

    @property
    def declared_inputs(self) -> tuple[ModInput, ...]:
        return _cached_expressions(self.score_mod, self.mask_mod, self.mod_inputs)[2]

    @property
    def has_expressions(self) -> bool:
        return self.score_mod is not None or self.mask_mod is not None

    def compile_arch(self, device_arch: str) -> str:
        return device_arch

    def with_additive_mask(self) -> BackwardSpec:
        return self if self.additive_mask else _with_additive_mask(self)

    def canonical_json(self) -> str:
        return json.dumps(self.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)


def _round_up(value: int, step: int) -> int:
    return -(-value // step) * step


@functools.lru_cache(maxsize=256)
def _cached_expressions(
    score_mod: str | None, mask_mod: str | None, mod_inputs: tuple[str, ...]
) -> tuple[Expression | None, Expression | None, tuple[ModInput, ...]]:
    return spec_expressions(score_mod, mask_mod, mod_inputs)


@functools.lru_cache(maxsize=256)
def _with_additive_mask(spec: BackwardSpec) -> BackwardSpec:
    return BackwardSpec(**{**spec.model_dump(), "additive_mask": True})
