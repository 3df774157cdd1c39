"""What a tuning record is keyed by: the problem bucket, the device and the software.

A record is only ever used when all three parts match exactly, so a record tuned on another
GPU, with other templates or with another kernelgen, NVRTC or CuPy version is never read.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from functools import cache

from kernelgen.arch import ARCHS, arch_for_capability, nearest_arch
from kernelgen.errors import InputError
from kernelgen.spec import DTYPE_ALIASES, MAX_HEAD_DIM, normalize_dtype  # noqa: F401 (the one table: spec's)

_DTYPE_SHORT = {"float32": "f32", "float16": "f16", "bfloat16": "bf16"}


def pow2_bucket(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1): the bucket of a sequence length."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def canonical_digest(data: object) -> str:
    """sha256 of sorted, compact JSON: the identity of a JSON-able value."""
    text = json.dumps(data, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return hashlib.sha256(text.encode()).hexdigest()


@dataclass(frozen=True)
class ProblemDesc:
    """One attention call's shape: q (B, H, Sq, D), k and v (B, Hkv, Sk, D); ``page_size``:
    k and v in a paged cache of pages of that many keys (Sk per sequence), 0: contiguous."""

    dtype: str
    batch: int
    num_heads: int
    num_kv_heads: int
    seqlen_q: int
    seqlen_k: int
    head_dim: int
    causal: bool = False
    mask: bool = False
    page_size: int = 0
    variants: tuple[str, ...] = ()  # the built-in variants' spec flags (docs/variants.md)

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", normalize_dtype(self.dtype))
        sizes = ("batch", "num_heads", "num_kv_heads", "seqlen_q", "seqlen_k", "head_dim")
        for name in sizes:
            if int(getattr(self, name)) < 1:
                raise InputError(f"{name}={getattr(self, name)} is not allowed; use >= 1")
        if self.num_heads % self.num_kv_heads:
            raise InputError(
                f"num_heads={self.num_heads} is not divisible by num_kv_heads={self.num_kv_heads}"
            )
        if self.page_size < 0 or self.page_size % 16:  # as attention_with_kvcache refuses it
            raise InputError(
                f"page_size={self.page_size} is not allowed; use 0 (contiguous K/V) or a "
                "multiple of 16"
            )
        if self.head_dim % 8 or self.head_dim > MAX_HEAD_DIM:  # as attention() refuses it
            raise InputError(
                f"head_dim={self.head_dim} is not allowed; use a multiple of 8 from 8 to "
                f"{MAX_HEAD_DIM}"
            )

    @classmethod
    def from_shape(
        cls, shape: str | tuple[int, ...], dtype: str, causal: bool = False, mask: bool = False
    ) -> ProblemDesc:
        """From ``"B,H,HKV,SQ,SK,D"`` (or a 6-tuple in that order)."""
        if isinstance(shape, str):
            try:
                shape = tuple(int(x) for x in shape.replace(" ", "").split(","))
            except ValueError:
                raise InputError(
                    f"shape={shape!r} is not allowed; use six integers B,H,HKV,SQ,SK,D"
                ) from None
        if len(shape) != 6:
            raise InputError(f"shape={shape!r} is not allowed; use six integers B,H,HKV,SQ,SK,D")
        return cls(dtype, *shape, causal=causal, mask=mask)

    @property
    def gqa_ratio(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def batch_heads(self) -> int:
        return self.batch * self.num_heads

    def bucket(self) -> ProblemBucket:
        return ProblemBucket(
            dtype=self.dtype,
            head_dim=self.head_dim,
            causal=self.causal,
            mask=self.mask,
            gqa_ratio=self.gqa_ratio,
            seqlen_q=pow2_bucket(self.seqlen_q),
            seqlen_k=pow2_bucket(self.seqlen_k),
            batch_heads=pow2_bucket(self.batch_heads),
            page_size=self.page_size,
            variants=tuple(self.variants),
        )


@dataclass(frozen=True)
class ProblemBucket:
    """The part of a problem a record is keyed by: sequence lengths and B*H rounded up to 2^k."""

    dtype: str
    head_dim: int
    causal: bool
    mask: bool
    gqa_ratio: int
    seqlen_q: int
    seqlen_k: int
    batch_heads: int
    page_size: int = 0  # exact: paged K/V and its page size are layouts, not sizes to round
    variants: tuple[str, ...] = ()  # kernels with other variants are other candidates

    @property
    def label(self) -> str:
        return "_".join(
            [
                *self.variants,
                _DTYPE_SHORT[self.dtype],
                f"d{self.head_dim}",
                "causal" if self.causal else "full",
                "mask" if self.mask else "nomask",
                f"g{self.gqa_ratio}",
                f"q{self.seqlen_q}",
                f"k{self.seqlen_k}",
                f"bh{self.batch_heads}",
                *([f"page{self.page_size}"] if self.page_size else []),
            ]
        )


@dataclass(frozen=True)
class DeviceInfo:
    """The GPU a record was tuned on (name, compute capability ``"9.0"``, SM count)."""

    name: str
    compute_capability: str
    sm_count: int
    l2_bytes: int = field(default=0, compare=False)  # sizes the L2 rotation; not in the key

    @property
    def arch(self) -> str:
        major, minor = (int(x) for x in self.compute_capability.split("."))
        return arch_for_capability(major, minor)

    @property
    def target_arch(self) -> str:
        """The known architecture whose limits candidates are checked against."""
        if self.arch in ARCHS:
            return self.arch
        nearest = nearest_arch(int(self.arch.removeprefix("sm_")))
        if nearest is None:
            raise InputError(f"compute capability {self.compute_capability} is below sm_80")
        return nearest

    def key_dict(self) -> dict[str, object]:
        return {
            "name": self.name,
            "compute_capability": self.compute_capability,
            "sm_count": self.sm_count,
        }


@dataclass(frozen=True)
class SoftwareInfo:
    """Versions that change the generated code or its compilation."""

    kernelgen: str
    template_hash: str
    nvrtc: str | None = None
    cuda_runtime: str | None = None
    cupy: str | None = None


@cache
def local_software(nvrtc: str | None, cuda_runtime: str | None, cupy: str | None) -> SoftwareInfo:
    """kernelgen's own version and template hash plus the given toolchain versions."""
    from kernelgen.render import template_hash
    from kernelgen.version import __version__

    return SoftwareInfo(__version__, template_hash(), nvrtc, cuda_runtime, cupy)


def environment_id(device: DeviceInfo, software: SoftwareInfo) -> str:
    """Short digest of a device and a toolchain: records of another one are never used."""
    return canonical_digest({"device": device.key_dict(), "software": asdict(software)})[:12]


@dataclass(frozen=True)
class TuningKey:
    """problem bucket x device x software: equal keys may share a record, nothing else."""

    problem: ProblemBucket
    device: DeviceInfo
    software: SoftwareInfo

    def as_dict(self) -> dict[str, dict[str, object]]:
        """JSON-able; a problem without variants keeps the key it had before variants existed."""
        problem: dict[str, object] = asdict(self.problem)
        if not self.problem.page_size:  # contiguous K/V: the keys (and ids) from before paging
            del problem["page_size"]
        if self.problem.variants:
            problem["variants"] = list(self.problem.variants)
        else:
            del problem["variants"]
        return {
            "problem": problem,
            "device": self.device.key_dict(),
            "software": asdict(self.software),
        }

    @property
    def environment_id(self) -> str:
        """Short digest of the device and software parts (:func:`environment_id`)."""
        return environment_id(self.device, self.software)

    @property
    def id(self) -> str:
        """Readable, unique file stem, e.g. ``bf16_d128_causal_nomask_g1_q1024_..-3fa2c0d19b7e``."""
        return f"{self.problem.label}-{canonical_digest(self.as_dict())[:12]}"

    @classmethod
    def from_dict(cls, data: dict) -> TuningKey:
        problem = dict(data["problem"])
        problem["variants"] = tuple(problem.get("variants", ()))
        return cls(
            ProblemBucket(**problem),
            DeviceInfo(**data["device"]),
            SoftwareInfo(**data["software"]),
        )
