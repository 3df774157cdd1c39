"""Compile a kernel's CUDA source for the CPU (g++, cached) and launch it over NumPy arrays.

The model and its limits: docs/emulator.md. Entry points: :func:`build_kernel` and
:class:`EmulatedKernel` (re-exported by :mod:`kernelgen.emulator`).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import re
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kernelgen.emulator.tensor_map import TENSOR_MAP_BYTES, TensorMap
from kernelgen.emulator.transform import transform_preprocessed
from kernelgen.errors import (
    EmulatorArgumentError,
    EmulatorArgumentTypeError,
    EmulatorCompileError,
    EmulatorLaunchError,
    EmulatorSettingError,
    EmulatorSourceError,
    EmulatorTimeoutError,
    EmulatorUnavailableError,
    HazardError,
)
from kernelgen.fileio import private_dir, user_cache_home

__all__ = ["EmulatedKernel", "LaunchStats", "build_kernel", "build_kernels", "include_dir"]

log = logging.getLogger(__name__)

INCLUDE_DIR = Path(__file__).resolve().parent / "include"
SHIM_NAME = "kg_emulator.h"

CXX_FLAGS = (
    "-std=c++20",
    # -Og: the optimisations that do not slow compiling; g++ spent 13-26 % less time than at
    # -O1 on the two kernels timed (a forward, a backward), the suite about the same run time
    # (the results are the same at any level: ISO C++ mode, so no FMA contraction, and
    # x86-64's SSE arithmetic is IEEE)
    "-Og",
    "-pthread",
    "-shared",
    "-fPIC",
    "-fno-strict-aliasing",
)
MAX_DYNAMIC_SMEM = 227 * 1024
MAX_POINTER_ARGS = 64  # kMaxArgRanges in kg_emulator.h
DEFAULT_FILL_BYTE = 0xFF
DEFAULT_TIMEOUT_S = 120.0
BLOCK_ORDER_ENV = "KG_EMULATOR_BLOCK_ORDER"
MAX_BLOCK_ORDER_SEED = 2**63 - 1  # the seed travels in a long long of the launch config
MAX_SHUFFLED_BLOCKS = 1 << 24  # kMaxShuffledBlocks in kg_emulator.h
_CODEGEN_VERSION = "7"
GXX_INSTALL_HINT = (
    "install it with your system's package manager (Debian/Ubuntu: apt-get install g++; "
    "Fedora/RHEL: dnf install gcc-c++; conda: conda install -c conda-forge gxx) or point "
    "KG_EMULATOR_CXX at another C++20 compiler"
)


def include_dir() -> Path:
    """The folder of the emulator's headers (kg_emulator.h, kg_ptx.h and the CUDA stand-ins)."""
    return INCLUDE_DIR


# --------------------------------------------------------------------------------------------
# Parameter types
# --------------------------------------------------------------------------------------------

_SCALAR_CTYPES: dict[str, Any] = {
    "int": ctypes.c_int32,
    "signed": ctypes.c_int32,
    "signed int": ctypes.c_int32,
    "int32_t": ctypes.c_int32,
    "unsigned": ctypes.c_uint32,
    "unsigned int": ctypes.c_uint32,
    "uint32_t": ctypes.c_uint32,
    "long long": ctypes.c_int64,
    "long long int": ctypes.c_int64,
    "signed long long": ctypes.c_int64,
    "int64_t": ctypes.c_int64,
    "long": ctypes.c_long,
    "unsigned long long": ctypes.c_uint64,
    "unsigned long long int": ctypes.c_uint64,
    "uint64_t": ctypes.c_uint64,
    "unsigned long": ctypes.c_ulong,
    "size_t": ctypes.c_size_t,
    "short": ctypes.c_int16,
    "unsigned short": ctypes.c_uint16,
    "bool": ctypes.c_bool,
    "float": ctypes.c_float,
    "double": ctypes.c_double,
}

# Element type of a pointer parameter -> numpy dtypes accepted for it (None: anything).
_POINTEE_DTYPES: dict[str, tuple[str, ...] | None] = {
    "__half": ("float16", "uint16"),
    "half": ("float16", "uint16"),
    "__nv_bfloat16": ("uint16", "bfloat16"),
    "nv_bfloat16": ("uint16", "bfloat16"),
    "float": ("float32",),
    "double": ("float64",),
    "int": ("int32",),
    "int32_t": ("int32",),
    "unsigned": ("uint32",),
    "unsigned int": ("uint32",),
    "uint32_t": ("uint32",),
    "long long": ("int64",),
    "int64_t": ("int64",),
    "unsigned long long": ("uint64",),
    "uint64_t": ("uint64",),
    "short": ("int16",),
    "unsigned short": ("uint16",),
    "uint16_t": ("uint16",),
    "int8_t": ("int8",),
    "signed char": ("int8",),
    "bool": ("bool",),
    "float2": ("float32",),
    "float4": ("float32",),
    "int4": ("int32",),
    "uint4": ("uint32",),
}

_TYPE_RE = re.compile(r"^[A-Za-z_][A-Za-z_0-9\s\*]*$")
# A tensor map passed by value (`const __grid_constant__ CUtensorMap name`): its argument is a
# kernelgen.emulator.TensorMap.
_TENSOR_MAP_TYPE_RE = re.compile(
    r"(?:(?:const|__grid_constant__)\s+)*(?:CUtensorMap|CUtensorMap_st)"
)
_TENSOR_MAP_PARAM = ctypes.c_ubyte * TENSOR_MAP_BYTES
_IDENT_RE = re.compile(r"^[A-Za-z_][A-Za-z_0-9]*$")


@dataclass(frozen=True)
class _Param:
    c_type: str  # as spelled in the wrapper (restrict qualifiers removed)
    name: str
    is_pointer: bool
    scalar: Any  # ctypes type for scalars
    dtypes: tuple[str, ...] | None  # accepted dtypes for pointers (None: any)


def _normalize_type(c_type: str) -> str:
    t = re.sub(r"\b(__restrict__|__restrict|restrict)\b", " ", c_type)
    t = t.replace("*", " * ")
    return " ".join(t.split()).replace(" *", "*")


def _parse_param(c_type: str, name: str) -> _Param:
    if not isinstance(c_type, str) or not _TYPE_RE.match(c_type.strip()):
        raise EmulatorSourceError(f"unsupported parameter type {c_type!r} for {name!r}")
    if not isinstance(name, str) or not _IDENT_RE.match(name):
        raise EmulatorSourceError(f"bad parameter name {name!r}")
    t = _normalize_type(c_type)
    if _TENSOR_MAP_TYPE_RE.fullmatch(t):
        return _Param("CUtensorMap", name, False, _TENSOR_MAP_PARAM, None)
    if t.endswith("*"):
        if t.count("*") > 1:
            raise EmulatorSourceError(
                f"unsupported pointer-to-pointer parameter {c_type!r} for {name!r}"
            )
        base = " ".join(w for w in t.rstrip("*").split() if w not in ("const", "volatile"))
        return _Param(t, name, True, None, _POINTEE_DTYPES.get(base))
    base = " ".join(w for w in t.split() if w != "const")
    if base not in _SCALAR_CTYPES:
        raise EmulatorSourceError(f"unsupported scalar parameter type {c_type!r} for {name!r}")
    return _Param(t, name, False, _SCALAR_CTYPES[base], None)


def _wrapper(kernel_name: str, params: Sequence[_Param]) -> str:
    """The launch wrapper of one kernel: ``kg_emulator_launch_<name>`` and
    ``kg_emulator_cluster_dims_<name>`` (a library built from one source holds one per kernel)."""
    args = ",\n      ".join(
        f"::kg_emu::arg<{p.c_type}>(a[{i}]) /* {p.name} */" for i, p in enumerate(params)
    )
    return f"""
// ---- generated by kernelgen.emulator: launch wrapper of {kernel_name} ----
namespace kg_emu_generated {{
static void thunk_{kernel_name}(void** a) {{
  (void)a;
  ::{kernel_name}(
      {args});
}}
}}  // namespace kg_emu_generated

extern "C" int kg_emulator_cluster_dims_{kernel_name}(long long* out) {{
  return ::kg_emu::cluster_dims_of("{kernel_name}", out);
}}

extern "C" int kg_emulator_launch_{kernel_name}(void** args, const long long* cfg,
                                  long long* stats, const unsigned long long* ranges,
                                  int nranges, long long* arg_stats, char* note, int notelen,
                                  char* err, int errlen) {{
  return ::kg_emu::launch(&kg_emu_generated::thunk_{kernel_name}, &::kg_emu::enter_fiber, args,
                          cfg, stats, ranges,
                          nranges, arg_stats, note, notelen, err, errlen);
}}
"""


# --------------------------------------------------------------------------------------------
# Compilation and cache
# --------------------------------------------------------------------------------------------


def cache_dir() -> Path:
    """Where compiled kernels live: ``$KG_EMULATOR_CACHE``, else
    ``$XDG_CACHE_HOME/kernelgen/emulator`` (``~/.cache/kernelgen/emulator``). The folder's
    libraries are loaded into the process, so it is created private (0700) and refused
    (:class:`~kernelgen.errors.UnsafeFolderError`) when another user owns it or others may
    write to it."""
    explicit = os.environ.get("KG_EMULATOR_CACHE")
    folder = Path(explicit) if explicit else user_cache_home() / "kernelgen" / "emulator"
    return private_dir(folder)


def compiler_available() -> bool:
    """Whether the emulator's C++ compiler (g++, or $KG_EMULATOR_CXX) is on PATH."""
    return shutil.which(os.environ.get("KG_EMULATOR_CXX", "g++")) is not None


def _compiler() -> str:
    cxx = os.environ.get("KG_EMULATOR_CXX", "g++")
    path = shutil.which(cxx)
    if path is None:
        raise EmulatorUnavailableError(
            f"the CPU emulator compiles kernels with g++ (a C++20 compiler), and {cxx!r} is not "
            f"on PATH: {GXX_INSTALL_HINT}"
        )
    return path


@functools.lru_cache(maxsize=8)
def _compiler_version(path: str) -> str:
    res = subprocess.run([path, "--version"], capture_output=True, text=True, check=False)
    return res.stdout.splitlines()[0] if res.stdout else ""


def _shim_text() -> str:
    """The emulator's own code: its headers and the Python modules that translate sources."""
    parts = [f"== {f.name}\n{f.read_text()}" for f in sorted(INCLUDE_DIR.iterdir()) if f.is_file()]
    here = Path(__file__).resolve().parent
    parts += [f"== {name}\n{(here / name).read_text()}" for name in ("kernel.py", "transform.py")]
    return "\n".join(parts)


# The shim (kg_emulator.h and the C++ standard headers it pulls in: some 66,000 preprocessed
# lines) is the same for every kernel and took most of a small kernel's build. It is compiled
# once into a precompiled header, and each kernel's translation unit starts with
# `#include "kg_emulator.h"` in place of the shim's preprocessed text (g++ picks the .gch up
# from the folder searched first; any mismatch falls back to the header itself).
PCH_FLAGS = tuple(f for f in CXX_FLAGS if f != "-shared")
# The shim's runtime (the runner of the threads, the launch) is compiled once into a library of
# its own that the kernels' libraries link (found beside them: rpath $ORIGIN), so that a
# kernel's build compiles only what the kernel uses: a sixth to a quarter less g++ time.
RUNTIME_DEFINE = "-DKG_EMU_EXTERN_RUNTIME"
RUNTIME_STEM = "libkg_emu_runtime"


def _shared_key(cxx: str, flags: Sequence[str], shim: str) -> str:
    """What identifies a build every kernel shares: compiler, flags and the shim's text."""
    return hashlib.sha256(
        "\0".join([_compiler_version(cxx), " ".join(flags), shim]).encode()
    ).hexdigest()[:24]


def _build_once(command: list[str], tmp: Path, dest: Path, what: str) -> bool:
    """Runs the compiler ``command`` (writing ``tmp``) and moves the result to ``dest``
    atomically; False (with a warning naming ``what``) when it fails."""
    res = subprocess.run(command, capture_output=True, text=True, check=False)
    if res.returncode != 0:
        tmp.unlink(missing_ok=True)
        log.warning("cannot build %s; kernels compile it each time", what)
        return False
    os.replace(tmp, dest)
    return True


def _runtime_library(cxx: str, cache: Path, shim: str) -> Path | None:
    """The shim's runtime library for this compiler, flags and ``shim`` text, built once
    (atomically); None when it cannot be built (then every kernel's library holds the
    runtime)."""
    name = f"{RUNTIME_STEM}-{_shared_key(cxx, CXX_FLAGS, shim)}.so"
    path = cache / name
    if path.exists():
        return path
    stem = f".{name}.{os.getpid()}.{threading.get_ident()}"
    source, tmp = cache / f"{stem}.cpp", cache / f"{stem}.tmp"
    source.write_text(f'#define KG_EMU_RUNTIME_BUILD 1\n#include "{SHIM_NAME}"\n')
    built = _build_once(
        [
            cxx,
            *CXX_FLAGS,
            # Only `launch` is exported, and the library binds its own inline functions to
            # itself: a kernel's library (loaded first) must not interpose on them.
            "-fvisibility=hidden",
            "-Wl,-Bsymbolic",
            "-I",
            str(INCLUDE_DIR),
            f"-Wl,-soname,{name}",
            "-o",
            str(tmp),
            str(source),
        ],
        tmp,
        path,
        "the emulator's runtime library",
    )
    source.unlink(missing_ok=True)
    return path if built else None


def _precompiled_shim(cxx: str, cache: Path, extern_runtime: bool, shim: str) -> Path | None:
    """The folder holding ``kg_emulator.h.gch`` for this compiler, flags and ``shim`` text
    (declaring the runtime, or holding it), built once (atomically); None when it cannot be
    built (then kernels compile the shim's text)."""
    flags = (*PCH_FLAGS, RUNTIME_DEFINE) if extern_runtime else PCH_FLAGS
    folder = cache / f"pch-{_shared_key(cxx, flags, shim)}"
    gch = folder / f"{SHIM_NAME}.gch"
    if gch.exists():
        return folder
    folder.mkdir(exist_ok=True)
    tmp = gch.with_name(f".{gch.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    command = [cxx, *flags, "-x", "c++-header", str(INCLUDE_DIR / SHIM_NAME), "-o", str(tmp)]
    return folder if _build_once(command, tmp, gch, "the emulator's precompiled shim") else None


def _without_shim_text(text: str, kernel_name: str) -> str | None:
    """Preprocessed ``text`` with everything before the kernel's own source (the force-included
    shim) replaced by ``#include "kg_emulator.h"``; None when the boundary is not found."""
    marker = f'\n# 1 "{kernel_name}.cu"\n'
    start = text.find(marker)
    if start < 0:
        return None
    return f'#include "{SHIM_NAME}"\n' + text[start + 1 :]


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _preprocess(
    cxx: str, source: str, kernel_name: str, include_dirs: Sequence[str], defines: Sequence[str]
) -> str:
    """``g++ -E`` of the source with the shim force-included; linemarkers name the source
    ``<kernel_name>.cu`` so that diagnostics point at its lines."""
    with tempfile.TemporaryDirectory(prefix="kg_emulator_") as tmp:
        name = f"{kernel_name}.cu"
        (Path(tmp) / name).write_text(source)
        cmd = [cxx, "-E", "-x", "c++", "-std=c++20", "-DKG_EMULATOR_PREPROCESS"]
        cmd += ["-include", SHIM_NAME, "-I", str(INCLUDE_DIR)]
        cmd += [f"-I{d}" for d in include_dirs] + [f"-D{d}" for d in defines] + [name]
        res = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp, check=False)
    if res.returncode != 0:
        raise EmulatorCompileError(kernel_name, res.stderr, None)
    return res.stdout


@dataclass(frozen=True)
class LaunchStats:
    """What one launch did (summed over its blocks); fields in kg_emulator.h's LaunchStat order."""

    ldmatrix: int = 0  # ldmatrix instructions, one per warp
    ldmatrix_wavefronts: int = 0  # shared-memory wavefronts they took
    ldmatrix_ideal: int = 0  # wavefronts without bank conflicts (one per 8x8 matrix)
    cp_async_global_bytes: int = 0  # global bytes of the cp.async copies issued (src-size)
    wgmma: int = 0  # wgmma.mma_async instructions, one per warpgroup
    tma_bytes: int = 0  # shared-memory bytes TMA and bulk copies wrote (whole boxes)
    first_conflict: str = ""  # the first ldmatrix that took extra wavefronts, or ""
    # Per pointer argument (by parameter name) whose array held the source address: cp.async
    # copies issued (zero-fill copies included) and their global bytes (src-size).
    cp_async_copies_by_arg: Mapping[str, int] = field(default_factory=dict)
    cp_async_bytes_by_arg: Mapping[str, int] = field(default_factory=dict)

    def __add__(self, other: LaunchStats) -> LaunchStats:
        def add(a: Mapping[str, int], b: Mapping[str, int]) -> dict[str, int]:
            return {k: a.get(k, 0) + b.get(k, 0) for k in {**a, **b}}

        return LaunchStats(
            self.ldmatrix + other.ldmatrix,
            self.ldmatrix_wavefronts + other.ldmatrix_wavefronts,
            self.ldmatrix_ideal + other.ldmatrix_ideal,
            self.cp_async_global_bytes + other.cp_async_global_bytes,
            self.wgmma + other.wgmma,
            self.tma_bytes + other.tma_bytes,
            self.first_conflict or other.first_conflict,
            add(self.cp_async_copies_by_arg, other.cp_async_copies_by_arg),
            add(self.cp_async_bytes_by_arg, other.cp_async_bytes_by_arg),
        )


_NUM_STATS = 6  # the counters kg_emulator.h fills (kNumStats): the first six fields
_LAUNCH_ERRORS = {2: HazardError, 3: EmulatorTimeoutError}


_loaded: dict[str, ctypes.CDLL] = {}
_loaded_lock = threading.Lock()


class EmulatedKernel:
    """A compiled kernel; call it like a launch: ``kern(grid=, block=, shared_mem=, args=)``."""

    def __init__(
        self,
        lib: ctypes.CDLL,
        kernel_name: str,
        params: Sequence[_Param],
        so_path: Path,
        compile_seconds: float,
    ):
        self.kernel_name = kernel_name
        self.params = tuple((p.c_type, p.name) for p in params)
        self.so_path = so_path
        self.source_path = so_path.with_suffix(".cpp")
        self.compile_seconds = compile_seconds  # 0.0 when the library came from the cache
        self._params = tuple(params)
        self._lib = lib
        self._launch = getattr(lib, f"kg_emulator_launch_{kernel_name}")
        self._launch.restype = ctypes.c_int
        dims = (ctypes.c_longlong * 3)()
        # The kernel's __cluster_dims__, or None.
        found = getattr(lib, f"kg_emulator_cluster_dims_{kernel_name}")(dims)
        self.cluster_dims: tuple[int, int, int] | None = (
            (int(dims[0]), int(dims[1]), int(dims[2])) if found else None
        )
        self._launch.argtypes = [
            ctypes.POINTER(ctypes.c_void_p),
            ctypes.POINTER(ctypes.c_longlong),
            ctypes.POINTER(ctypes.c_longlong),
            ctypes.POINTER(ctypes.c_ulonglong),
            ctypes.c_int,
            ctypes.POINTER(ctypes.c_longlong),
            ctypes.c_char_p,
            ctypes.c_int,
            ctypes.c_char_p,
            ctypes.c_int,
        ]

    def __repr__(self) -> str:
        return f"EmulatedKernel({self.kernel_name!r}, {self.so_path})"

    def _convert(self, p: _Param, value: Any) -> Any:
        if p.scalar is _TENSOR_MAP_PARAM:
            if not isinstance(value, TensorMap):
                raise EmulatorArgumentTypeError(
                    f"{self.kernel_name}: argument {p.name!r} (CUtensorMap) needs a TensorMap "
                    f"from kernelgen.emulator.encode_tensor_map_tiled, got {type(value).__name__}"
                )
            return _TENSOR_MAP_PARAM.from_buffer_copy(value.blob)
        if p.is_pointer:
            if value is None:
                return ctypes.c_void_p(None)
            if not isinstance(value, np.ndarray):
                raise EmulatorArgumentTypeError(
                    f"{self.kernel_name}: argument {p.name!r} ({p.c_type}) needs a numpy array "
                    f"or None, got {type(value).__name__}"
                )
            if p.dtypes is not None and value.dtype.name not in p.dtypes:
                raise EmulatorArgumentTypeError(
                    f"{self.kernel_name}: argument {p.name!r} ({p.c_type}) needs dtype "
                    f"{' or '.join(p.dtypes)}, got {value.dtype}"
                )
            return ctypes.c_void_p(value.ctypes.data)
        if isinstance(value, np.ndarray) and value.ndim == 0:
            value = value[()]
        is_bool = isinstance(value, (bool, np.bool_))
        if p.scalar is ctypes.c_bool:
            if not isinstance(value, (bool, np.bool_, int, np.integer)):
                raise EmulatorArgumentTypeError(
                    f"{self.kernel_name}: {p.name!r} ({p.c_type}) needs a bool"
                )
            return ctypes.c_bool(bool(value))
        if p.scalar in (ctypes.c_float, ctypes.c_double):
            if is_bool or not isinstance(value, (int, float, np.integer, np.floating)):
                raise EmulatorArgumentTypeError(
                    f"{self.kernel_name}: {p.name!r} ({p.c_type}) needs a number, "
                    f"got {type(value).__name__}"
                )
            return p.scalar(float(value))
        if is_bool or not isinstance(value, (int, np.integer)):
            raise EmulatorArgumentTypeError(
                f"{self.kernel_name}: {p.name!r} ({p.c_type}) needs an integer, "
                f"got {type(value).__name__}"
            )
        v = int(value)
        bits = ctypes.sizeof(p.scalar) * 8
        signed = p.scalar(-1).value < 0
        lo, hi = (-(1 << (bits - 1)), (1 << (bits - 1)) - 1) if signed else (0, (1 << bits) - 1)
        if not lo <= v <= hi:
            raise EmulatorArgumentError(
                f"{self.kernel_name}: {p.name!r} = {v} does not fit {p.c_type}"
            )
        return p.scalar(v)

    def __call__(
        self,
        grid: Sequence[int] | int = (1, 1, 1),
        block: Sequence[int] | int = (32, 1, 1),
        shared_mem: int = 0,
        args: Sequence[Any] = (),
        *,
        timeout: float | None = None,
        block_order: int | None = None,
        cluster: Sequence[int] | int | None = None,
    ) -> LaunchStats:
        """Run the kernel over ``grid`` blocks of ``block`` threads; ``args`` in parameter order.

        ``timeout`` is the per-block watchdog in seconds (default ``$KG_EMULATOR_TIMEOUT``, else
        120). ``block_order`` picks the order the blocks run in: 0 in order (x fastest, then y,
        then z), an integer seed > 0 a pseudo-random permutation of the grid's blocks, the same
        for the same seed; ``None`` takes ``$KG_EMULATOR_BLOCK_ORDER`` (unset: 0). Running a
        kernel in several orders shows whether its results depend on block scheduling (e.g.
        floating-point atomics from different blocks). ``cluster`` is the thread-block cluster
        shape (``cudaLaunchAttributeClusterDimension``): the blocks of a cluster run at once
        (at most 8 blocks and 4096 threads per cluster); ``None`` takes the kernel's
        ``__cluster_dims__`` (none: clusters of one block). With clusters ``block_order`` orders
        the clusters.
        """
        g, b = _dims(grid, "grid"), _dims(block, "block")
        c = _cluster(cluster, self.cluster_dims, g, b, self.kernel_name)
        if b[0] > 1024 or b[1] > 1024 or b[2] > 64:
            raise EmulatorArgumentError(f"block {b} exceeds the CUDA limits (1024, 1024, 64)")
        nthreads = b[0] * b[1] * b[2]
        if nthreads % 32 or nthreads > 1024:
            raise EmulatorArgumentError(
                f"block {b} has {nthreads} threads; the emulator needs a multiple of 32, "
                "at most 1024"
            )
        if g[1] > 65535 or g[2] > 65535 or g[0] > 2**31 - 1:
            raise EmulatorArgumentError(f"grid {g} exceeds the CUDA limits")
        shared_mem = int(shared_mem)
        if not 0 <= shared_mem <= MAX_DYNAMIC_SMEM:
            raise EmulatorArgumentError(f"shared_mem={shared_mem} outside [0, {MAX_DYNAMIC_SMEM}]")
        pointers = sum(p.is_pointer for p in self._params)
        if pointers > MAX_POINTER_ARGS:
            raise EmulatorArgumentError(
                f"{self.kernel_name} has {pointers} pointer parameters; at most {MAX_POINTER_ARGS}"
            )
        seed = _block_order(block_order)
        if seed > 0 and g[0] * g[1] * g[2] // (c[0] * c[1] * c[2]) > MAX_SHUFFLED_BLOCKS:
            raise EmulatorArgumentError(
                f"block_order={seed} shuffles at most {MAX_SHUFFLED_BLOCKS} blocks, grid {g} has "
                f"{g[0] * g[1] * g[2]}; use block_order=0 (in order)"
            )
        if len(args) != len(self._params):
            raise EmulatorArgumentTypeError(
                f"{self.kernel_name} takes {len(self._params)} arguments "
                f"({', '.join(n for _, n in self.params)}), got {len(args)}"
            )
        values = [self._convert(p, v) for p, v in zip(self._params, args, strict=True)]
        argv = (ctypes.c_void_p * max(1, len(values)))(*[ctypes.addressof(v) for v in values])
        if timeout is None:
            timeout = float(os.environ.get("KG_EMULATOR_TIMEOUT", DEFAULT_TIMEOUT_S))
        fill = int(os.environ.get("KG_EMULATOR_SMEM_FILL", str(DEFAULT_FILL_BYTE)), 0) & 0xFF
        cfg = (ctypes.c_longlong * 13)(*g, *b, shared_mem, fill, int(timeout * 1000), seed, *c)
        err = ctypes.create_string_buffer(1024)
        note = ctypes.create_string_buffer(256)
        stats = (ctypes.c_longlong * _NUM_STATS)()
        arrays = [
            (p.name, v)
            for p, v in zip(self._params, args, strict=True)
            if p.is_pointer and isinstance(v, np.ndarray) and v.nbytes > 0
        ]
        bounds = [b for _, v in arrays for b in _byte_range(v)]
        ranges = (ctypes.c_ulonglong * max(1, len(bounds)))(*bounds)
        arg_stats = (ctypes.c_longlong * max(1, 2 * len(arrays)))()
        rc = self._launch(
            argv, cfg, stats, ranges, len(arrays), arg_stats, note, len(note), err, len(err)
        )
        if rc != 0:
            error = _LAUNCH_ERRORS.get(rc, EmulatorLaunchError)
            raise error(self.kernel_name, err.value.decode())
        copies: dict[str, int] = {}
        nbytes: dict[str, int] = {}
        for i, (name, _) in enumerate(arrays):
            copies[name] = copies.get(name, 0) + arg_stats[i]
            nbytes[name] = nbytes.get(name, 0) + arg_stats[len(arrays) + i]
        return LaunchStats(*stats, note.value.decode(), copies, nbytes)


MAX_CLUSTER_BLOCKS = 8  # kMaxClusterSize in kg_emulator.h
MAX_CLUSTER_THREADS = 4096  # kMaxClusterThreads


def _cluster(
    value: Sequence[int] | int | None,
    compiled: tuple[int, int, int] | None,
    grid: tuple[int, int, int],
    block: tuple[int, int, int],
    kernel: str,
) -> tuple[int, int, int]:
    """The cluster shape of a launch: ``value`` (checked against the kernel's
    ``__cluster_dims__``), else that, else (1, 1, 1); the grid must be a multiple of it."""
    if value is None:
        c = compiled or (1, 1, 1)
    else:
        c = _dims(value, "cluster")
        if compiled is not None and c != compiled:
            raise EmulatorArgumentError(
                f"{kernel}: cluster={c} differs from the kernel's __cluster_dims__{compiled}"
            )
    size = c[0] * c[1] * c[2]
    threads = size * block[0] * block[1] * block[2]
    if size > MAX_CLUSTER_BLOCKS or threads > MAX_CLUSTER_THREADS:
        raise EmulatorArgumentError(
            f"cluster {c} of {size} blocks, {threads} threads: the emulator runs at most "
            f"{MAX_CLUSTER_BLOCKS} blocks and {MAX_CLUSTER_THREADS} threads of a cluster at once"
        )
    if any(gd % cd for gd, cd in zip(grid, c, strict=True)):
        raise EmulatorArgumentError(f"grid {grid} is not a multiple of the cluster {c}")
    return c


def _byte_range(a: np.ndarray) -> tuple[int, int]:
    """[lo, hi) of the bytes an array (any strides) touches."""
    lo = hi = a.ctypes.data
    for size, stride in zip(a.shape, a.strides, strict=True):
        span = (size - 1) * stride
        lo, hi = (lo + span, hi) if stride < 0 else (lo, hi + span)
    return lo, hi + a.itemsize


def _block_order(value: int | None) -> int:
    """The block order seed of a launch: ``value``, else ``$KG_EMULATOR_BLOCK_ORDER`` (read now,
    unset or empty: 0); 0 runs the blocks in order, a seed > 0 shuffles them."""
    allowed = (
        f"a non-negative integer seed up to {MAX_BLOCK_ORDER_SEED} (0: blocks in order; "
        "> 0: a pseudo-random block order, the same for the same seed)"
    )
    if value is None:
        raw = os.environ.get(BLOCK_ORDER_ENV, "")
        if not raw.strip():
            return 0
        try:
            seed = int(raw, 10)
        except ValueError:
            seed = -1
        if not 0 <= seed <= MAX_BLOCK_ORDER_SEED:
            raise EmulatorSettingError(f"{BLOCK_ORDER_ENV}={raw!r} is not allowed; use {allowed}")
        return seed
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise EmulatorArgumentTypeError(
            f"block_order must be None or an integer, got {type(value).__name__}"
        )
    if not 0 <= int(value) <= MAX_BLOCK_ORDER_SEED:
        raise EmulatorArgumentError(f"block_order={int(value)} is not allowed; use {allowed}")
    return int(value)


def _dims(v: Sequence[int] | int, what: str) -> tuple[int, int, int]:
    t = (v,) if isinstance(v, (int, np.integer)) else tuple(v)
    if not 1 <= len(t) <= 3:
        raise EmulatorArgumentError(f"{what} must have 1 to 3 dimensions, got {v!r}")
    t = tuple(int(x) for x in t) + (1,) * (3 - len(t))
    if any(x < 1 for x in t):
        raise EmulatorArgumentError(f"{what} dimensions must be >= 1, got {v!r}")
    return t  # type: ignore[return-value]


def build_kernel(
    source: str,
    kernel_name: str,
    params: Sequence[tuple[str, str]],
    *,
    include_dirs: Sequence[str | os.PathLike] = (),
    defines: Mapping[str, str | int] | None = None,
) -> EmulatedKernel:
    """Compile ``kernel_name`` from CUDA ``source`` for the CPU (cached) and return a launcher.

    ``params`` are the kernel's ``(c_type, name)`` parameters, in order. ``include_dirs`` are
    searched by the source's ``#include``s (e.g. a CUTLASS checkout), ``defines`` become ``-D``
    macros (``__CUDA_ARCH__`` is not defined unless given). The source is preprocessed first,
    then its dynamic shared memory and inline PTX are rewritten (:mod:`.transform`).

    Raises :class:`~kernelgen.errors.EmulatorUnavailableError` without g++,
    :class:`~kernelgen.errors.EmulatorSourceError` for unsupported parameters or constructs (an
    inline-PTX instruction the emulator does not model) and
    :class:`~kernelgen.errors.EmulatorCompileError` (with the compiler's output) when the source
    does not compile.
    """
    kernels = build_kernels(
        source, {kernel_name: params}, include_dirs=include_dirs, defines=defines
    )
    return kernels[kernel_name]


def build_kernels(
    source: str,
    kernels: Mapping[str, Sequence[tuple[str, str]]],
    *,
    include_dirs: Sequence[str | os.PathLike] = (),
    defines: Mapping[str, str | int] | None = None,
) -> dict[str, EmulatedKernel]:
    """Several kernels of one CUDA ``source`` (name -> its ``(c_type, name)`` parameters) in one
    library, by one compiler run: :func:`build_kernel`'s launchers, by name. A source's kernels
    are compiled whichever of them is asked for, so building its siblings together costs one
    build instead of one each (a split-KV spec's combine, the backward family's three)."""
    if not isinstance(kernels, Mapping) or not kernels:
        raise EmulatorSourceError(f"kernels must name at least one kernel, got {kernels!r}")
    for kernel_name in kernels:
        if not isinstance(kernel_name, str) or not _IDENT_RE.match(kernel_name):
            raise EmulatorSourceError(f"bad kernel name {kernel_name!r}")
    names = sorted(kernels)  # the library is the same whatever order they are asked in
    parsed = {n: [_parse_param(t, p) for t, p in kernels[n]] for n in names}
    stem = names[0]  # the source's file name in diagnostics and the cache
    dirs = [str(Path(d).resolve()) for d in include_dirs]
    defs = [f"{k}={v}" for k, v in (defines or {}).items()]
    for d in defs:
        if not re.fullmatch(r"[A-Za-z_]\w*=[^\n]*", d):
            raise EmulatorSourceError(f"bad define {d!r}: expected NAME=value")
    cxx = _compiler()
    shim = _shim_text()  # read once: the kernel's key, the runtime's and the header's
    # With only the emulator's and the system's headers the inputs identify the build; headers
    # of include_dirs may change under the same paths, so then the preprocessed text does.
    text = _preprocess(cxx, source, stem, dirs, defs) if dirs else None
    signature = [(n, [(p.c_type, p.name) for p in parsed[n]]) for n in names]
    key = hashlib.sha256(
        "\0".join(
            [
                _CODEGEN_VERSION,
                _compiler_version(cxx),
                " ".join(CXX_FLAGS),
                shim,
                repr(signature),
                "\n".join(defs),
                text if text is not None else source,
            ]
        ).encode()
    ).hexdigest()[:32]
    cache = cache_dir()
    so_path = cache / f"{stem}-{key}.so"
    compile_seconds = 0.0
    # With the caller's defines the shim is compiled as the kernel's text (they may change
    # it), so neither the precompiled header nor the runtime library fits. A cached kernel's
    # library may link the runtime library: it is made again if it was deleted.
    runtime = None if defs else _runtime_library(cxx, cache, shim)
    if not so_path.exists():
        t0 = time.perf_counter()
        if text is None:
            text = _preprocess(cxx, source, stem, dirs, defs)
        cpp = transform_preprocessed(text, (str(INCLUDE_DIR),)) + "".join(
            '\n# 1 "kg_emulator_wrapper.cpp"\n' + _wrapper(n, parsed[n]) for n in names
        )
        pch = None if defs else _precompiled_shim(cxx, cache, runtime is not None, shim)
        short = _without_shim_text(cpp, stem) if pch is not None else None
        search = ["-I", str(pch), "-I", str(INCLUDE_DIR)] if short is not None else []
        link: list[str] = []
        if short is not None and runtime is not None:
            search.insert(0, RUNTIME_DEFINE)
            link = ["-L", str(cache), f"-l:{runtime.name}", "-Wl,-rpath,$ORIGIN"]
        cpp_path = cache / f"{stem}-{key}.cpp"
        _write_atomic(cpp_path, (short if short is not None else cpp).encode())
        tmp_so = so_path.with_name(f".{so_path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        res = subprocess.run(
            [cxx, *CXX_FLAGS, *search, "-o", str(tmp_so), str(cpp_path), *link],
            capture_output=True,
            text=True,
            check=False,
        )
        compile_seconds = time.perf_counter() - t0
        if res.returncode != 0:
            tmp_so.unlink(missing_ok=True)
            raise EmulatorCompileError(", ".join(names), res.stdout + res.stderr, str(cpp_path))
        os.replace(tmp_so, so_path)
    with _loaded_lock:
        lib = _loaded.get(str(so_path))
        if lib is None:
            lib = ctypes.CDLL(str(so_path))
            _loaded[str(so_path)] = lib
    return {
        n: EmulatedKernel(lib, n, parsed[n], so_path, compile_seconds)
        for n in kernels  # in the caller's order
    }
