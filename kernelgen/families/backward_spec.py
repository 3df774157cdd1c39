"""The backward family's spec: a frozen Pydantic model of one attention backward kernel set.

A backward spec fixes everything that is a compile-time constant of the kernels that compute
dQ, dK and dV from dO (docs/backward.md): the engine, dtype, head dim, tiling, the mask and
the variants compiled in, and how dQ is accumulated. Its ``uri`` names the kernels, the file
under generated/ and every cache entry, as a forward spec's does.
"""

from __future__ import annotations

import functools
import json
import math
import numbers
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

from kernelgen.arch import ARCHS, DEFAULT_ARCHS
from kernelgen.errors import SpecError
from kernelgen.expressions import Expression, ModInput, spec_expressions
from kernelgen.spec import (
    DTYPE_BYTES,
    DTYPE_SHORT,
    EXPRESSION_FIELDS,
    EXPRESSION_TAGS,
    MAX_ACCUMULATORS_PER_THREAD,
    MAX_HEAD_DIM,
    VARIANT_FLAGS,
    VARIANT_TAGS,
    DType,
)

BackwardEngine = Literal["simt"]
# Tiles of the CUDA-core backward: a block owns BLOCK_N keys and walks BLOCK_M queries at a time.
BACKWARD_TILES = (16, 32, 64)
BACKWARD_WARPS = (1, 2, 4, 8)
# Words of padding after each shared-memory row of Q, K, V and dO: an odd row stride in words,
# so the rows a warp reads at one column fall in different banks.
BACKWARD_SMEM_PAD_WORDS = 1


class BackwardSpec(BaseModel):
    """Kernels of one FlashAttention backward pass (preprocess, main, dQ), fully determined."""

    model_config = ConfigDict(frozen=True, extra="forbid", validate_default=True)

    family: Literal["backward"] = Field(
        description="The kernel family: 'backward' (dQ, dK, dV of attention)."
    )
    mma: BackwardEngine = Field(
        "simt",
        description="The engine: simt (fp32 FMA on CUDA cores, every dtype; the readable "
        "reference family).",
    )
    dtype: DType = Field(description="Element type of q, k, v, out, dout and the gradients.")
    head_dim: int = Field(description="Head dimension D: a multiple of 8, at most 256.")
    block_m: int = Field(32, description="Query rows per tile a block walks: 16, 32 or 64.")
    block_n: int = Field(32, description="Keys a block owns (its dK, dV rows): 16, 32 or 64.")
    num_warps: int = Field(4, description="Warps per thread block: 1, 2, 4 or 8.")
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
    archs: tuple[str, ...] = Field(DEFAULT_ARCHS, description="GPU architectures it must fit.")

    @model_serializer(mode="wrap")
    def _drop_defaults_that_are_off(self, handler: Any) -> dict[str, Any]:
        """Flags that are off and absent expressions are left out of dumps, as in forward specs."""
        data = handler(self)
        for name in (*VARIANT_FLAGS, "additive_mask", "deterministic"):
            if data.get(name) is False:
                del data[name]
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
        if not isinstance(data, dict) or not any(
            data.get(name) is not None for name in (*EXPRESSION_FIELDS, "mod_inputs")
        ):
            return data
        data = dict(data)
        texts = [data.get(name) for name in EXPRESSION_FIELDS]
        for name, text in zip(EXPRESSION_FIELDS, texts, strict=True):
            if text is not None and not isinstance(text, str):
                raise ValueError(f"{name}={text!r:.80} is not allowed; use a string expression")
        signatures = data.get("mod_inputs") or ()
        if isinstance(signatures, str) or not isinstance(signatures, (list, tuple)):
            raise ValueError(
                f"mod_inputs={signatures!r:.80} is not allowed; use a list of name:dtype[rank]"
            )
        try:
            score, mask, declared = spec_expressions(*texts, signatures)
        except SpecError as exc:
            raise ValueError("\n".join(exc.problems)) from None
        data["score_mod"] = None if score is None else score.text
        data["mask_mod"] = None if mask is None else mask.text
        data["mod_inputs"] = tuple(i.signature for i in declared)
        return data

    @field_validator("head_dim", "block_m", "block_n", "num_warps", mode="before")
    @classmethod
    def _strict_integer(cls, value: Any, info: Any) -> Any:
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise ValueError(
                f"{info.field_name}={value!r:.80} is not allowed; use an integer "
                f"({type(value).__name__} given)"
            )
        return int(value)

    @field_validator("causal", "deterministic", "additive_mask", *VARIANT_FLAGS, mode="before")
    @classmethod
    def _strict_boolean(cls, value: Any, info: Any) -> Any:
        if type(value).__module__ == "numpy" and type(value).__name__ in ("bool", "bool_"):
            return bool(value)
        if not isinstance(value, bool):
            raise ValueError(f"{info.field_name}={value!r:.80} is not allowed; use true or false")
        return value

    @field_validator("head_dim")
    @classmethod
    def _check_head_dim(cls, value: int) -> int:
        if value <= 0 or value % 8 or value > MAX_HEAD_DIM:
            raise ValueError(
                f"head_dim={value} is not allowed; use a multiple of 8 from 8 to {MAX_HEAD_DIM}"
            )
        return value

    @field_validator("block_m", "block_n")
    @classmethod
    def _check_tile(cls, value: int, info: Any) -> int:
        if value not in BACKWARD_TILES:
            raise ValueError(
                f"{info.field_name}={value} is not allowed; use one of "
                f"{', '.join(map(str, BACKWARD_TILES))}"
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
        unknown = [a for a in value if a not in ARCHS]
        if unknown or not value:
            raise ValueError(
                f"archs={list(value)} is not allowed; use a non-empty list of {', '.join(ARCHS)}"
            )
        return tuple(value)

    @model_validator(mode="after")
    def _check_geometry(self) -> BackwardSpec:
        problems = []
        if self.mod_inputs and not self.has_expressions:
            problems.append(
                "mod_inputs are declared but the spec has no score_mod or mask_mod; remove them"
            )
        limit = MAX_ACCUMULATORS_PER_THREAD["simt"]
        if self.accumulators_per_thread > limit:
            problems.append(
                f"block_n={self.block_n} x head_dim={self.head_dim} gives each of "
                f"{self.threads} threads {self.accumulators_per_thread} dK and dV accumulators "
                f"(at most {limit}); use a smaller block_n or more warps"
            )
        for arch in self.archs:
            if self.smem_bytes > ARCHS[arch].max_smem_per_block:
                problems.append(
                    f"{self.smem_bytes} bytes of shared memory per block, over the "
                    f"{ARCHS[arch].max_smem_per_block} of {arch}; use smaller block_m or block_n"
                )
        if problems:
            raise ValueError("\n".join(problems))
        return self

    # ---- derived geometry (single source for render, launch and validation) --------------
    @property
    def threads(self) -> int:
        return 32 * self.num_warps

    @property
    def elem_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def smem_row_elems(self) -> int:
        """Row stride of the Q, K, V and dO tiles in shared memory, in elements."""
        return self.head_dim + BACKWARD_SMEM_PAD_WORDS * 4 // self.elem_bytes

    @property
    def prob_row_floats(self) -> int:
        """Row stride of the fp32 P and dS tiles (one extra word moves rows to other banks)."""
        return self.block_n + 1

    @property
    def accumulators_per_thread(self) -> int:
        """fp32 registers of a thread's share of the block's dK and dV rows."""
        return 2 * math.ceil(self.block_n * self.head_dim / self.threads)

    @property
    def smem_bytes(self) -> int:
        """Dynamic shared memory of the main and dQ kernels: K, V, Q and dO tiles, the P and dS
        tiles, and the rows' lse and D."""
        tiles = 2 * (self.block_m + self.block_n) * self.smem_row_elems * self.elem_bytes
        return tiles + 2 * self.block_m * self.prob_row_floats * 4 + 2 * self.block_m * 4

    @property
    def uri(self) -> str:
        """Canonical readable name, e.g. ``fa_bwd_simt_bf16_d128_m32_n32_w4_causal_det``."""
        parts = [
            "fa_bwd",
            self.mma,
            DTYPE_SHORT[self.dtype],
            f"d{self.head_dim}",
            f"m{self.block_m}",
            f"n{self.block_n}",
            f"w{self.num_warps}",
        ]
        if self.causal:
            parts.append("causal")
        if self.additive_mask:
            parts.append("amask")
        parts += [VARIANT_TAGS[name] for name in VARIANT_FLAGS if getattr(self, name)]
        parts += [f"{EXPRESSION_TAGS[e.kind]}{e.hash}" for e in self.expressions if e is not None]
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

    @property
    def block_sparse(self) -> bool:
        """Backward kernels visit every key tile a mask leaves (no block mask yet)."""
        return False

    def compile_arch(self, device_arch: str) -> str:
        return device_arch

    def with_additive_mask(self) -> BackwardSpec:
        return self if self.additive_mask else _with_additive_mask(self)

    def canonical_json(self) -> str:
        return json.dumps(self.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)


@functools.lru_cache(maxsize=256)
def _cached_expressions(
    score_mod: str | None, mask_mod: str | None, mod_inputs: tuple[str, ...]
) -> tuple[Expression | None, Expression | None, tuple[ModInput, ...]]:
    return spec_expressions(score_mod, mask_mod, mod_inputs)


@functools.lru_cache(maxsize=256)
def _with_additive_mask(spec: BackwardSpec) -> BackwardSpec:
    return BackwardSpec(**{**spec.model_dump(), "additive_mask": True})
