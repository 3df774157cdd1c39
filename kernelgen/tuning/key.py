"""What a tuning record is keyed by: the problem bucket, the device and the software.

A record is only ever used when all three parts match exactly, so a record tuned on another
GPU, with other templates or with another kernelgen, NVRTC or CuPy version is never read.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import asdict, dataclass, field
from functools import cache

from kernelgen.errors import InputError
from kernelgen.families import FAMILIES
from kernelgen.specs.arch import ARCHS, arch_for_capability, nearest_arch
from kernelgen.specs.forward import (
    DTYPE_ALIASES,
    FP8_DTYPE,
    FP8_HEAD_DIMS,
    MAX_HEAD_DIM,
    VARIANT_FLAGS,
    normalize_dtype,
)

_DTYPE_SHORT = {"float32": "f32", "float16": "f16", "bfloat16": "bf16", FP8_DTYPE: "e4m3"}
# The names of fp8 (e4m3) a problem takes besides DTYPE_ALIASES' (which only name the dtypes
# every kernel path takes): the spec's, its short tag, torch's and ml_dtypes'.
FP8_ALIASES = (FP8_DTYPE, "e4m3", "float8_e4m3fn")


def problem_dtype(name: str) -> str:
    """A problem's dtype by its full name: :func:`normalize_dtype`'s, or ``float8_e4m3`` for
    :data:`FP8_ALIASES`; InputError naming every allowed name otherwise."""
    if str(name).lower() in FP8_ALIASES:
        return FP8_DTYPE
    try:
        return normalize_dtype(name)
    except InputError:
        allowed = ", ".join([*DTYPE_ALIASES, *FP8_ALIASES])
        raise InputError(f"dtype={name!r} is not allowed; use one of {allowed}") from None


def fp8_problems(head_dim: int, mask: bool, family: str) -> list[str]:
    """What an fp8 (float8_e4m3) problem may not have: the fp8 kernels' limits (docs/hopper.md,
    fp8: head dims 64, 96, 128, 192 and 256, no mask or backward; the built-in variants and
    paged caches are allowed); empty when it fits."""
    limits = (
        ("head_dim", head_dim, head_dim not in FP8_HEAD_DIMS, " or ".join(map(str, FP8_HEAD_DIMS))),
        ("mask", mask, bool(mask), "False"),
        ("family", family, family != "forward", "'forward'"),
    )
    return [
        f"{name}={value!r} is not allowed with dtype={FP8_DTYPE!r}; use {allowed} (the fp8 "
        "kernels: docs/hopper.md, fp8)"
        for name, value, refused, allowed in limits
        if refused
    ]


def pow2_bucket(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1): the bucket of a sequence length."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def spec_fields(problem: ProblemDesc | ProblemBucket) -> dict[str, object]:
    """The spec fields every kernel for ``problem`` has: what each candidate is built with, and
    what a record's winner must match (a backward problem: a backward spec's)."""
    if problem.family == "backward":
        return {
            "family": "backward",
            "dtype": problem.dtype,
            "head_dim": problem.head_dim,
            "causal": problem.causal,
            "additive_mask": problem.mask,
            "deterministic": problem.deterministic,
            **{name: True for name in problem.variants},
        }
    return {
        "dtype": problem.dtype,
        "head_dim": problem.head_dim,
        "causal": problem.causal,
        "paged_kv": problem.page_size > 0,
        "additive_mask": problem.mask,
        **{name: True for name in problem.variants},
    }


def canonical_digest(data: object) -> str:
    """sha256 of sorted, compact JSON: the identity of a JSON-able value."""
    text = json.dumps(data, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return hashlib.sha256(text.encode()).hexdigest()


@dataclass(frozen=True)
class ProblemDesc:
    """One attention call's shape: q (B, H, Sq, D), k and v (B, Hkv, Sk, D); ``page_size``:
    k and v in a paged cache of pages of that many keys (Sk per sequence), 0: contiguous.
    ``family``: the forward call (``"forward"``) or its gradients (``"backward"``, with dQ
    ``deterministic`` or accumulated with atomics)."""

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
    family: str = "forward"
    deterministic: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", problem_dtype(self.dtype))
        if self.family not in FAMILIES:
            raise InputError(f"family={self.family!r} is not allowed; use one of {FAMILIES}")
        if self.deterministic and self.family != "backward":
            raise InputError("deterministic=True is a backward option; use family='backward'")
        if self.page_size and self.family == "backward":
            raise InputError("a backward problem has no paged KV cache; use page_size=0")
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
        if self.dtype == FP8_DTYPE:
            refused = fp8_problems(self.head_dim, self.mask, self.family)
            if refused:
                raise InputError(refused[0])

    @property
    def fp8(self) -> bool:
        """An fp8 (e4m3) problem: tuned over the fp8 loops only (:func:`candidates.fp8_fields`)."""
        return self.dtype == FP8_DTYPE

    @classmethod
    def from_shape(
        cls,
        shape: str | tuple[int, ...],
        dtype: str,
        causal: bool = False,
        mask: bool = False,
        *,
        family: str = "forward",
        deterministic: bool = False,
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
        return cls(
            dtype, *shape, causal=causal, mask=mask, family=family, deterministic=deterministic
        )

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
            family=self.family,
            deterministic=self.deterministic,
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
    family: str = "forward"  # backward problems: another kernel family, other candidates
    deterministic: bool = False  # backward: dQ without atomics

    @property
    def label(self) -> str:
        """E.g. ``bf16_d128_causal_nomask_g1_q2048_k2048_bh64``; a backward problem's starts
        with ``bwd_`` (and ends with ``_det`` when deterministic)."""
        return "_".join(
            [
                *(["bwd"] if self.family == "backward" else []),
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
                *(["det"] if self.deterministic else []),
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
    from kernelgen.kernels.render import template_hash
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
        """JSON-able; a forward problem without variants keeps the key it had before variants
        (and backward problems) existed: fields at their defaults are left out."""
        problem: dict[str, object] = asdict(self.problem)
        if self.problem.family == "forward":
            del problem["family"]
        if not self.problem.deterministic:
            del problem["deterministic"]
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
    def from_dict(cls, data: object) -> TuningKey:
        """The key of a record file or an imported bundle (untrusted text): every field checked
        (:func:`key_problems`); ValueError listing what is wrong."""
        problems = key_problems(data)
        if problems:
            raise ValueError("bad tuning key: " + "; ".join(problems))
        assert isinstance(data, dict)
        problem = dict(data["problem"])
        problem["variants"] = tuple(problem.get("variants", ()))
        return cls(
            ProblemBucket(**problem),
            DeviceInfo(**data["device"]),
            SoftwareInfo(**data["software"]),
        )


# A key's fields as a record file holds them: JSON type, and whether the field may be absent.
_PROBLEM_FIELDS: dict[str, tuple[type, bool]] = {
    "dtype": (str, False),
    "head_dim": (int, False),
    "causal": (bool, False),
    "mask": (bool, False),
    "gqa_ratio": (int, False),
    "seqlen_q": (int, False),
    "seqlen_k": (int, False),
    "batch_heads": (int, False),
    "page_size": (int, True),
    "variants": (list, True),
    "family": (str, True),
    "deterministic": (bool, True),
}
_DEVICE_FIELDS: dict[str, tuple[type, bool]] = {
    "name": (str, False),
    "compute_capability": (str, False),
    "sm_count": (int, False),
}
_SOFTWARE_FIELDS: dict[str, tuple[type | None, bool]] = {
    "kernelgen": (str, False),
    "template_hash": (str, False),
    "nvrtc": (None, True),  # None: a string or null
    "cuda_runtime": (None, True),
    "cupy": (None, True),
}
MAX_KEY_TEXT = 200  # characters of a device name or a version string


def _field_problems(
    part: str, data: object, fields: dict[str, tuple[type | None, bool]]
) -> list[str]:
    """Type problems of one part of a key: missing, unknown or mistyped fields."""
    if not isinstance(data, dict):
        return [f"{part} is {type(data).__name__}, not an object"]
    problems = [f"{part}.{name} is not a field" for name in data if name not in fields]
    for name, (kind, optional) in fields.items():
        if name not in data:
            if not optional:
                problems.append(f"{part}.{name} is missing")
            continue
        value = data[name]
        if kind is None:
            ok = value is None or (isinstance(value, str) and len(value) <= MAX_KEY_TEXT)
            want = f"null or a string of at most {MAX_KEY_TEXT} characters"
        elif kind is int:
            ok, want = isinstance(value, int) and not isinstance(value, bool), "an integer"
        elif kind is str:
            ok = isinstance(value, str) and len(value) <= MAX_KEY_TEXT
            want = f"a string of at most {MAX_KEY_TEXT} characters"
        else:
            ok, want = isinstance(value, kind), kind.__name__
        if not ok:
            problems.append(f"{part}.{name}={value!r:.60} is not {want}")
    return problems


def _problem_value_problems(problem: dict) -> list[str]:
    """Value problems of a (well-typed) problem bucket: what no real call produces."""
    problems = []
    if problem["dtype"] not in _DTYPE_SHORT:
        problems.append(f"problem.dtype={problem['dtype']!r} is not one of {sorted(_DTYPE_SHORT)}")
    head_dim = problem["head_dim"]
    if head_dim % 8 or not 8 <= head_dim <= MAX_HEAD_DIM:
        problems.append(
            f"problem.head_dim={head_dim} is not a multiple of 8 from 8 to {MAX_HEAD_DIM}"
        )
    if problem["gqa_ratio"] < 1:
        problems.append(f"problem.gqa_ratio={problem['gqa_ratio']} is not at least 1")
    for name in ("seqlen_q", "seqlen_k", "batch_heads"):  # buckets: powers of two
        if problem[name] < 1 or pow2_bucket(problem[name]) != problem[name]:
            problems.append(f"problem.{name}={problem[name]} is not a power of two")
    page_size = problem.get("page_size", 0)
    if page_size < 0 or page_size % 16:
        problems.append(f"problem.page_size={page_size} is not 0 or a multiple of 16")
    variants = problem.get("variants", [])
    known = all(isinstance(v, str) and v in VARIANT_FLAGS for v in variants)
    if not known or len(set(variants)) != len(variants):
        problems.append(
            f"problem.variants={variants!r:.80} are not distinct names from {list(VARIANT_FLAGS)}"
        )
    family = problem.get("family", "forward")
    if family not in FAMILIES:
        problems.append(f"problem.family={family!r:.60} is not one of {list(FAMILIES)}")
    elif family == "forward" and problem.get("deterministic", False):
        problems.append("problem.deterministic=True is not a forward problem's field")
    elif family == "backward" and page_size:
        problems.append(f"problem.page_size={page_size} for a backward problem (no paged cache)")
    if problem["dtype"] == FP8_DTYPE:
        refused = fp8_problems(head_dim, problem["mask"], family)
        problems += [f"problem.{text}" for text in refused]
    return problems


def key_problems(data: object) -> list[str]:
    """What is wrong with a key read from a file (empty: nothing): unknown, missing or mistyped
    fields, a dtype outside the table, sizes no call produces, unknown variant names. Checked
    before any field is used, e.g. in the record's file name."""
    if not isinstance(data, dict):
        return [f"the key is {type(data).__name__}, not an object"]
    parts = {"problem": _PROBLEM_FIELDS, "device": _DEVICE_FIELDS, "software": _SOFTWARE_FIELDS}
    problems = [f"{name} is not a part of a key" for name in data if name not in parts]
    for part, fields in parts.items():
        problems += _field_problems(part, data.get(part), fields)
    if problems:
        return problems
    if not re.fullmatch(r"\d{1,3}\.\d{1,3}", data["device"]["compute_capability"]):
        problems.append(
            f"device.compute_capability={data['device']['compute_capability']!r:.60} is not "
            "like '9.0'"
        )
    if data["device"]["sm_count"] < 1:
        problems.append(f"device.sm_count={data['device']['sm_count']} is not at least 1")
    return problems + _problem_value_problems(data["problem"])
