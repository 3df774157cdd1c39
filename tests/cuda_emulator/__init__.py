"""Run generated CUDA kernels on the CPU: a test-only host emulator.

The CUDA source of a kernel is compiled as ordinary C++20 by ``g++`` together with a small shim
header (``include/kg_emulator.h``, force-included) that supplies the CUDA subset our kernels use,
then loaded with :mod:`ctypes` and launched over numpy arrays::

    kern = build_kernel(source, "attn_fwd", [("const __half*", "q"), ..., ("int", "n")])
    stats = kern(grid=(gx, gy, gz), block=(128, 1, 1), shared_mem=nbytes, args=[q, ..., n])

What is modelled
----------------
* Threads: every CUDA thread of a block is a real OS thread (pthread), so ``__syncthreads``,
  ``__syncwarp``, shuffles and ballots really block until the other threads get there.
  ``threadIdx``/``blockIdx``/``blockDim``/``gridDim`` are thread-locals; warps are 32
  consecutive linear thread ids (x fastest, then y, then z), lanes are ``linear % 32``.
* Blocks run one at a time, in order (x fastest, then y, then z), reusing the same threads.
  Hence ``__shared__`` is ``static``: static shared arrays are plain static storage, and they
  keep the previous block's contents (they are zero only before the first block of the
  process, not garbage-filled).
* Dynamic shared memory: the declaration ``extern __shared__ <align> <type> NAME[];`` is
  rewritten into a pointer to a per-launch buffer of ``shared_mem`` bytes (128-byte aligned).
  Before every block the buffer is filled with a garbage byte (default 0xFF, i.e. NaN for
  float32, float16 and bfloat16, and -1 for integers; env ``KG_EMULATOR_SMEM_FILL`` changes it)
  so reading shared memory nobody wrote shows up. Guard zones on both sides are checked after
  each block: writing outside the buffer raises ``RuntimeError`` from the launch.
* ``__syncthreads()`` is a block-wide barrier, ``__syncwarp()`` a per-warp barrier. A thread
  that returns from the kernel drops out of both (like ``std::barrier::arrive_and_drop``), so
  the remaining threads do not deadlock.
* ``__shfl_sync`` / ``__shfl_xor_sync`` / ``__shfl_down_sync`` / ``__shfl_up_sync`` (any
  trivially copyable type up to 8 bytes, optional ``width`` with the PTX lane rules),
  ``__ballot_sync`` / ``__any_sync`` / ``__all_sync``: each lane publishes its value in a
  per-warp slot, warp barrier, reads its source lane's slot, warp barrier.
* ``__half`` / ``__nv_bfloat16``: 2-byte structs; float conversions are bit-exact
  round-to-nearest-even like the GPU (subnormals, overflow to inf, NaN -> canonical 0x7FFF).
  float16 data goes in as numpy ``float16`` arrays, bfloat16 as ``uint16`` bit patterns.
* ``__half2`` / ``__nv_bfloat162`` (4-byte structs, ``.x`` in the low half):
  ``__floats2half2_rn``, ``__floats2bfloat162_rn``, ``__float22half2_rn``,
  ``__float22bfloat162_rn``, ``__low2float``/``__high2float`` and a few constructors; each
  element rounds like the scalar conversions. No vector arithmetic.
* Inline PTX: every ``asm``/``__asm__`` statement is parsed at transform time (adjacent string
  literals concatenated, ``%N``/``%[name]`` operands numbered outputs first, ``"+"`` operands
  read and written, clobbers ignored) and rewritten into a call into ``include/kg_ptx.h``. An
  instruction outside this table is a ``ValueError`` naming it, never silently dropped:

  - ``ldmatrix.sync.aligned.m8n8.{x1,x2,x4}{.trans}.shared{::cta}.b16`` -> ``ptx::ldmatrix``
  - ``mma.sync.aligned.m16n8k16.row.col.f32.{f16,bf16}.{f16,bf16}.f32`` -> ``ptx::mma_m16n8k16``
  - ``cp.async.{ca,cg}.shared{::cta}.global{.L2::NB} [dst], [src], size{, src-size}``
    -> ``ptx::cp_async`` (``.ca``: 4, 8, 16 bytes; ``.cg``: 16)
  - ``cp.async.commit_group``, ``cp.async.wait_group N``, ``cp.async.wait_all``
  - an empty template (``asm volatile("" ::: "memory")``) -> a compiler barrier

  ``__cvta_generic_to_shared(p)`` maps a pointer into the dynamic shared memory to ``0x400 +``
  its byte offset (other pointers, e.g. static ``__shared__`` arrays, trap). ldmatrix and mma
  are warp-collective through the per-warp slots and barriers like the shuffles (ldmatrix reads
  shared memory while all 32 lanes are inside it). mma computes each product of 16-bit floats
  exactly in double, sums the 16 products and C in double and rounds once to fp32: the tensor
  cores' internal alignment/truncation differs in the last bits. Row addresses outside the
  buffer or not 16-byte aligned trap (``RuntimeError`` from the launch, naming the lane).
* ``cp.async`` is really asynchronous: the instruction only checks the addresses (destination
  inside the buffer and aligned to the copy size, source aligned when read, src-size <= size)
  and queues the copy in the thread's current group; ``commit_group`` closes that group;
  ``wait_group N`` performs, oldest first, every copy of all committed groups but the N newest;
  ``wait_all`` performs everything, uncommitted copies included. Before that the destination
  keeps its old bytes (garbage fill), so a kernel that reads too early, or another thread's
  data without the wait and a barrier, sees garbage. Global memory is read when the copy is
  performed; ``src-size`` < size zero-fills the rest. Copies still queued when a thread leaves
  the kernel are dropped.
* A race check of cp.async against ldmatrix (a small compute-sanitizer racecheck): every 16-byte
  chunk of dynamic shared memory is stamped with its last ldmatrix read and its last 16-byte
  cp.async write, in barrier epochs (``__syncthreads`` passed). The launch raises when a copy
  is issued into bytes another warp read since the last barrier, when ldmatrix reads a copy
  not yet waited for, or waited for by another thread with no barrier since, and when two
  copies into one chunk are in flight. Each access publishes its stamp before it checks the
  other's, so a hazard is reported on every run whatever the thread timing.
* Launch statistics: a launch returns :class:`LaunchStats`: ldmatrix instructions, the
  shared-memory wavefronts they took under the 32-bank model (one per 8x8 matrix when its 8
  rows sit in 8 different 16-byte bank groups, more when rows at different addresses share a
  group; ncu's ``l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld`` on the GPU) with the
  first conflicting instruction described, and the global bytes cp.async read (src-size).
* Math: <cmath> plus the CUDA spellings (``rsqrtf``, ``__expf``, ``__fdividef``, ...),
  ``min``/``max`` for mixed arithmetic types, ``__ldg`` and friends, integer/float atomics,
  ``__trap()`` (raises ``RuntimeError`` from the launch).
* A per-block watchdog (default 120 s, env ``KG_EMULATOR_TIMEOUT`` or ``timeout=`` on the call)
  turns a deadlocked block into ``RuntimeError`` instead of a hang; the stuck threads are left
  behind (blocked, not spinning), so prefer a subprocess when deadlock is expected.

What is NOT modelled
--------------------
* No memory model beyond the barriers: between barriers threads really race (as on the GPU,
  but with x86 ordering); no fences other than ``__threadfence*`` = full fence, no ``volatile``
  tricks, no memory spaces (a "shared" pointer is an ordinary pointer). The race check covers
  cp.async writes and ldmatrix reads only, not plain C++ loads and stores.
* No warp divergence semantics: shuffles, ``__syncwarp`` and ballots assume all 32 lanes of the
  warp take part (the ``mask`` argument is ignored); a partial warp deadlocks (watchdog) or
  reads stale values of lanes that already exited.
* No concurrency between blocks (inter-block communication through global memory spin-waits
  deadlocks), no streams, no launch limits beyond a 1024-thread block (multiple of 32) and
  227 KiB of dynamic shared memory.
* Inline PTX other than the table above: no other ``mma`` shapes or types, no ``wmma``, no
  ``stmatrix``, ``cp.async.bulk``/TMA, ``mbarrier``, special registers (``%laneid``), PTX
  ``{ .reg ... }`` blocks, predicates, ``asm goto``; no cp.async ``ignore-src`` or cache-policy
  operands. ``ldmatrix``/``cp.async`` reach only the dynamic shared memory, not static
  ``__shared__`` arrays. No ``__half2`` vector math, cooperative groups, textures.
* Floating point is the CPU's: no FMA contraction, ``expf``/``exp2f``/... from glibc
  (correctly rounded or nearly), the ``__``-fast-math intrinsics are the accurate functions,
  and subnormals are never flushed. Compare against references with tolerances.
* Out-of-bounds global memory accesses are not checked (they may crash the process).
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["EmulatedKernel", "EmulatorUnavailableError", "build_kernel", "transform_source"]

INCLUDE_DIR = Path(__file__).resolve().parent / "include"
SHIM = INCLUDE_DIR / "kg_emulator.h"

CXX_FLAGS = (
    "-std=c++20",
    "-O1",
    "-pthread",
    "-shared",
    "-fPIC",
    "-fno-strict-aliasing",
)
MAX_DYNAMIC_SMEM = 227 * 1024
DEFAULT_FILL_BYTE = 0xFF
DEFAULT_TIMEOUT_S = 120.0
_CODEGEN_VERSION = "2"


class EmulatorUnavailableError(RuntimeError):
    """The host C++ compiler needed by the emulator is not installed."""


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
        raise ValueError(f"unsupported parameter type {c_type!r} for {name!r}")
    if not isinstance(name, str) or not _IDENT_RE.match(name):
        raise ValueError(f"bad parameter name {name!r}")
    t = _normalize_type(c_type)
    if t.endswith("*"):
        if t.count("*") > 1:
            raise ValueError(f"unsupported pointer-to-pointer parameter {c_type!r} for {name!r}")
        base = " ".join(w for w in t.rstrip("*").split() if w not in ("const", "volatile"))
        return _Param(t, name, True, None, _POINTEE_DTYPES.get(base))
    base = " ".join(w for w in t.split() if w != "const")
    if base not in _SCALAR_CTYPES:
        raise ValueError(f"unsupported scalar parameter type {c_type!r} for {name!r}")
    return _Param(t, name, False, _SCALAR_CTYPES[base], None)


# --------------------------------------------------------------------------------------------
# Source transformation
# --------------------------------------------------------------------------------------------

_DYN_SMEM_RE = re.compile(r"\bextern\s+__shared__\s+(?P<body>[^;{}\[\]]+?)\[\s*\]\s*;")
_ALIGN_RE = re.compile(
    r"__align__\s*\(\s*\w+\s*\)|alignas\s*\(\s*\w+\s*\)|__attribute__\s*\(\(.*?\)\)"
)
# `extern "C" {` reads `extern " " {` once string contents are blanked.
_NS_OPENER_RE = re.compile(r'(?:\bnamespace\b[\w\s:]*|\bextern\s*"[^"]*"\s*)$')


def _blank_comments_and_strings(src: str) -> str:
    """The source with comments and string/char literal contents replaced by spaces."""
    out = list(src)
    i, n = 0, len(src)
    while i < n:
        c = src[i]
        if src.startswith("//", i):
            j = src.find("\n", i)
            j = n if j < 0 else j
            out[i:j] = " " * (j - i)
            i = j
        elif src.startswith("/*", i):
            j = src.find("*/", i + 2)
            j = n if j < 0 else j + 2
            out[i:j] = [ch if ch == "\n" else " " for ch in src[i:j]]
            i = j
        elif c in "\"'":
            j = i + 1
            while j < n and src[j] != c:
                j += 2 if src[j] == "\\" else 1
            out[i + 1 : min(j, n)] = " " * (min(j, n) - i - 1)
            i = j + 1
        else:
            i += 1
    return "".join(out)


def _at_namespace_scope(code: str, pos: int) -> bool:
    """Whether ``pos`` of comment/string-blanked ``code`` is outside any function body."""
    stack: list[bool] = []  # True: a namespace / extern "C" brace
    last = 0
    for m in re.finditer(r"[{};]", code[:pos]):
        ch = m.group()
        if ch == "{":
            head = code[last : m.start()].strip()
            stack.append(bool(_NS_OPENER_RE.search(head)))
        elif ch == "}" and stack:
            stack.pop()
        last = m.end()
    return all(stack)


def transform_source(source: str) -> str:
    """Prepare CUDA ``source`` for g++: rewrite ``extern __shared__ T NAME[];`` into a pointer to
    the emulated buffer and every inline-PTX ``asm`` statement into emulator calls.

    Line numbers are kept. Raises ``ValueError`` for a declaration or asm it cannot handle.
    """
    return _rewrite_asm(_rewrite_dynamic_smem(source))


def _rewrite_dynamic_smem(source: str) -> str:
    code = _blank_comments_and_strings(source)  # same offsets as `source`
    pieces: list[str] = []
    last = 0
    for k, m in enumerate(_DYN_SMEM_RE.finditer(code)):
        body = _ALIGN_RE.sub(" ", source[m.start("body") : m.end("body")])
        words = body.split()
        if len(words) < 2 or not _IDENT_RE.match(words[-1]):
            raise ValueError(f"cannot parse dynamic shared memory declaration {m.group()!r}")
        name, ctype = words[-1], " ".join(words[:-1])
        if _at_namespace_scope(code, m.start()):
            repl = (
                f"static {ctype}* {name} = nullptr; "
                f"static const bool kg_dyn_smem_hook_{k} = ::kg_emu::register_dyn_smem_hook("
                f"+[](unsigned char* p) {{ {name} = reinterpret_cast<{ctype}*>(p); }});"
            )
        else:
            repl = f"{ctype}* const {name} = reinterpret_cast<{ctype}*>(::kg_emu::dynamic_smem());"
        # Keep the line count so compiler diagnostics point at the right source lines.
        pieces += [source[last : m.start()], repl + "\n" * m.group().count("\n")]
        last = m.end()
    pieces.append(source[last:])
    out = "".join(pieces)
    if re.search(r"\bextern\s+__shared__\b", _blank_comments_and_strings(out)):
        raise ValueError("unrecognised `extern __shared__` declaration left in the source")
    return out


# --------------------------------------------------------------------------------------------
# Inline PTX: `asm("..." : outputs : inputs : clobbers)` -> calls into include/kg_ptx.h
# --------------------------------------------------------------------------------------------

_ASM_START_RE = re.compile(
    r"\b(?:asm|__asm__|__asm)(?P<quals>(?:\s+(?:volatile|__volatile__|__volatile|inline"
    r"|__inline__|goto)\b)*)\s*\("
)
_ASM_OPERAND_RE = re.compile(r'\s*(?:\[\s*(?P<name>\w+)\s*\]\s*)?"(?P<c>[^"]*)"\s*\(')
_ASM_TEMPLATE_RE = re.compile(r'\s*(?:"[^"]*"\s*)+')
_STRING_LITERAL_RE = re.compile(r'"[^"]*"')
_C_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\", '"': '"', "'": "'", "?": "?"}
_PTX_NS = "::kg_emu::ptx::"


class _AsmError(ValueError):
    pass


def _closing(code: str, open_pos: int) -> int:
    """Index of the bracket closing the one at ``open_pos`` (comment/string-blanked code)."""
    depth = 0
    for i in range(open_pos, len(code)):
        if code[i] in "([{":
            depth += 1
        elif code[i] in ")]}":
            depth -= 1
            if depth == 0:
                return i
    raise _AsmError("unbalanced brackets")


def _split_top(code: str, start: int, end: int, sep: str) -> list[tuple[int, int]]:
    """Spans of ``code[start:end]`` between the ``sep`` characters outside any brackets."""
    spans, depth, last = [], 0, start
    for i in range(start, end):
        ch = code[i]
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == sep and depth == 0:
            spans.append((last, i))
            last = i + 1
    spans.append((last, end))
    return spans


def _unescape(literal: str) -> str:
    def one(m: re.Match[str]) -> str:
        if m.group(1) not in _C_ESCAPES:
            raise _AsmError(f"unsupported escape sequence {m.group()!r} in the asm string")
        return _C_ESCAPES[m.group(1)]

    return re.sub(r"\\(.)", one, literal)


@dataclass(frozen=True)
class _AsmOperand:
    index: int  # GCC numbering: outputs first, then inputs
    constraint: str  # as written, e.g. "+f", "=r", "l", "n"
    expr: str  # the C++ expression between the parentheses
    output: bool
    tied_kind: str | None = None  # constraint letter of the output a "0"-style input is tied to

    @property
    def kind(self) -> str:
        letters = self.constraint.lstrip("=+&")
        return self.tied_kind if letters.isdigit() and self.tied_kind else letters

    @property
    def readable(self) -> bool:
        return not self.output or "+" in self.constraint

    def describe(self) -> str:
        return f'%{self.index} ("{self.constraint}"({self.expr}))'


@dataclass
class _AsmStatement:
    """One parsed asm statement; renders its operands for the roles the instructions give them."""

    template: str
    operands: list[_AsmOperand]
    names: dict[str, int]
    line: int

    def error(self, what: str) -> _AsmError:
        return _AsmError(f"inline PTX at line {self.line}: {what}")

    def operand(self, ref: int, kinds: str, write: bool, role: str) -> _AsmOperand:
        if not 0 <= ref < len(self.operands):
            raise self.error(f"%{ref} refers to no operand (there are {len(self.operands)})")
        op = self.operands[ref]
        if op.kind not in kinds:
            want = " or ".join(f'"{k}"' for k in kinds)
            raise self.error(f"{role} {op.describe()} needs constraint {want}")
        if write and not op.output:
            raise self.error(f"{role} {op.describe()} is written but is an input operand")
        if not write and not op.readable:
            raise self.error(f"{role} {op.describe()} is read but is a write-only output")
        return op

    def write_b32(self, ref: int, role: str) -> str:
        return f"({self.operand(ref, 'r', True, role).expr})"

    def read_b32(self, ref: int, role: str) -> str:
        return f"{_PTX_NS}b32({self.operand(ref, 'r', False, role).expr})"

    def write_f32(self, ref: int, role: str) -> str:
        return f"({self.operand(ref, 'f', True, role).expr})"

    def read_f32(self, ref: int, role: str) -> str:
        return f"static_cast<float>({self.operand(ref, 'f', False, role).expr})"

    def read_global(self, ref: int, role: str) -> str:
        return f"{_PTX_NS}global_ptr({self.operand(ref, 'l', False, role).expr})"

    def immediate(self, arg: tuple, role: str) -> str:
        if arg[0] == "imm":
            return str(arg[1])
        if arg[0] == "reg":
            return f"({self.operand(arg[1], 'ni', False, role).expr})"
        raise self.error(f"{role} must be an integer constant")


def _parse_asm(source: str, code: str, m: re.Match[str]) -> tuple[int, _AsmStatement]:
    """Parse the asm statement matched at ``m``; returns (end offset, statement)."""
    line = source.count("\n", 0, m.start()) + 1
    if "goto" in m.group("quals").split():
        raise _AsmError(f"inline PTX at line {line}: `asm goto` is not supported")
    open_pos = m.end() - 1
    close = _closing(code, open_pos)
    sections = _split_top(code, open_pos + 1, close, ":")
    if len(sections) > 4:
        raise _AsmError(f"inline PTX at line {line}: asm goto labels are not supported")
    t0, t1 = sections[0]
    if not _ASM_TEMPLATE_RE.fullmatch(code, t0, t1):
        raise _AsmError(
            f"inline PTX at line {line}: the instruction text must be string literals, "
            f"got {source[t0:t1].strip()!r}"
        )
    # Adjacent literals concatenate; their contents come from the original source.
    template = "".join(
        _unescape(source[lit.start() + 1 : lit.end() - 1])
        for lit in _STRING_LITERAL_RE.finditer(code, t0, t1)
    )
    operands: list[_AsmOperand] = []
    names: dict[str, int] = {}
    for section, is_output in zip(sections[1:3], (True, False), strict=False):
        if not code[section[0] : section[1]].strip():
            continue
        for s, e in _split_top(code, *section, ","):
            om = _ASM_OPERAND_RE.match(code, s, e)
            if om is None:
                raise _AsmError(
                    f"inline PTX at line {line}: cannot parse operand {source[s:e].strip()!r}"
                )
            paren = om.end() - 1
            rparen = _closing(code, paren)
            if code[rparen + 1 : e].strip() or rparen >= e:
                raise _AsmError(
                    f"inline PTX at line {line}: cannot parse operand {source[s:e].strip()!r}"
                )
            constraint = source[om.start("c") : om.end("c")]
            tied = None
            if not is_output and constraint.isdigit() and int(constraint) < len(operands):
                tied = operands[int(constraint)].kind
            if om.group("name"):
                names[om.group("name")] = len(operands)
            expr = source[paren + 1 : rparen].strip()
            operands.append(_AsmOperand(len(operands), constraint, expr, is_output, tied))
    return close + 1, _AsmStatement(template, operands, names, line)


def _resolve_operand_refs(stmt: _AsmStatement) -> str:
    """The template with ``%N`` / ``%[name]`` as ``$N`` and ``%%`` as ``%``."""

    def ref(m: re.Match[str]) -> str:
        tok = m.group()
        if tok == "%%":
            return "%"
        if m.group("num") is not None:
            return f"${m.group('num')}"
        if m.group("name") is not None:
            if m.group("name") not in stmt.names:
                raise stmt.error(f"unknown named operand {tok}")
            return f"${stmt.names[m.group('name')]}"
        raise stmt.error(f"unsupported operand reference {tok!r}")

    return re.sub(r"%%|%(?P<num>\d+)|%\[(?P<name>\w+)\]|%.?", ref, stmt.template)


def _ptx_instructions(stmt: _AsmStatement) -> list[str]:
    """Single-spaced instructions of the template (comments and the ``;`` removed)."""
    text = re.sub(r"//[^\n]*", " ", _resolve_operand_refs(stmt))
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    return [" ".join(part.split()) for part in text.split(";") if part.strip()]


def _ptx_args(stmt: _AsmStatement, text: str, instr: str) -> list[tuple]:
    """Parse a PTX operand list: ``{$0, $1}`` -> ("vec", [0, 1]), ``[$4]`` / ``[$4+16]`` ->
    ("addr", 4, 16), ``$2`` -> ("reg", 2), ``16`` -> ("imm", 16)."""
    args: list[tuple] = []
    if not text:
        return args
    for s, e in _split_top(text, 0, len(text), ","):
        a = text[s:e].strip()
        if m := re.fullmatch(r"\{\s*(\$\d+(?:\s*,\s*\$\d+)*)\s*\}", a):
            args.append(("vec", [int(x) for x in re.findall(r"\d+", m.group(1))]))
        elif m := re.fullmatch(r"\[\s*\$(\d+)\s*(?:\+\s*(\d+|0x[0-9a-fA-F]+)\s*)?\]", a):
            args.append(("addr", int(m.group(1)), int(m.group(2) or "0", 0)))
        elif m := re.fullmatch(r"\$(\d+)", a):
            args.append(("reg", int(m.group(1))))
        elif re.fullmatch(r"\d+|0x[0-9a-fA-F]+", a):
            args.append(("imm", int(a, 0)))
        else:
            raise stmt.error(f"unsupported operand {a!r} in {instr!r}")
    return args


def _expect(stmt: _AsmStatement, instr: str, args: list[tuple], shape: str) -> None:
    """Check the operand kinds, e.g. shape "vec4 vec4 vec2 vec4" or "addr addr imm"."""
    got = [a[0] + (str(len(a[1])) if a[0] == "vec" else "") for a in args]
    want = shape.split()
    ok = len(got) == len(want) and all(
        g == w or (w == "val" and g in ("reg", "imm")) for g, w in zip(got, want, strict=True)
    )
    if not ok:
        raise stmt.error(f"{instr!r}: expected operands {shape!r}, got {' '.join(got)!r}")


def _offset(expr: str, offset: int) -> str:
    return f"({expr} + {offset}u)" if offset else expr


def _ptx_ldmatrix(stmt: _AsmStatement, m: re.Match[str], instr: str, args: list[tuple]) -> str:
    n, trans = int(m.group(1)), m.group(2) is not None
    _expect(stmt, instr, args, f"vec{n} addr")
    regs = [stmt.write_b32(r, "ldmatrix destination") for r in args[0][1]]
    addr = _offset(stmt.read_b32(args[1][1], "ldmatrix address"), args[1][2])
    return f"{_PTX_NS}ldmatrix<{n}, {str(trans).lower()}>({addr}, {', '.join(regs)})"


def _ptx_mma(stmt: _AsmStatement, m: re.Match[str], instr: str, args: list[tuple]) -> str:
    if m.group(1) != m.group(2):
        raise stmt.error(f"{instr!r}: A and B must have the same type")
    _expect(stmt, instr, args, "vec4 vec4 vec2 vec4")
    d = [stmt.write_f32(r, "mma D") for r in args[0][1]]
    a = [stmt.read_b32(r, "mma A") for r in args[1][1]]
    b = [stmt.read_b32(r, "mma B") for r in args[2][1]]
    c = [stmt.read_f32(r, "mma C") for r in args[3][1]]
    elem = f"{_PTX_NS}Elem::{m.group(1)}"
    return f"{_PTX_NS}mma_m16n8k16<{elem}>({', '.join(d + a + b + c)})"


def _ptx_cp_async(stmt: _AsmStatement, m: re.Match[str], instr: str, args: list[tuple]) -> str:
    _expect(stmt, instr, args, "addr addr imm" if len(args) == 3 else "addr addr imm val")
    size = args[2][1]
    if size not in ((16,) if m.group(1) == "cg" else (4, 8, 16)):
        raise stmt.error(f"{instr!r}: cp-size {size} is not allowed with .{m.group(1)}")
    dst = _offset(stmt.read_b32(args[0][1], "cp.async destination"), args[0][2])
    src = stmt.read_global(args[1][1], "cp.async source")
    if args[1][2]:
        src = f"({src} + {args[1][2]})"
    call = f"{_PTX_NS}cp_async<{size}>({dst}, {src}"
    if len(args) == 4:
        src_size = args[3]
        is_constant = src_size[0] == "imm" or (
            src_size[1] < len(stmt.operands) and stmt.operands[src_size[1]].kind in ("n", "i")
        )
        if is_constant:
            call += f", {stmt.immediate(src_size, 'cp.async src-size')}"
        else:
            call += f", {stmt.read_b32(src_size[1], 'cp.async src-size')}"
    return call + ")"


def _ptx_commit(stmt: _AsmStatement, m: re.Match[str], instr: str, args: list[tuple]) -> str:
    _expect(stmt, instr, args, "")
    return f"{_PTX_NS}cp_async_commit_group()"


def _ptx_wait_group(stmt: _AsmStatement, m: re.Match[str], instr: str, args: list[tuple]) -> str:
    _expect(stmt, instr, args, "val")
    return f"{_PTX_NS}cp_async_wait_group({stmt.immediate(args[0], 'wait_group count')})"


def _ptx_wait_all(stmt: _AsmStatement, m: re.Match[str], instr: str, args: list[tuple]) -> str:
    _expect(stmt, instr, args, "")
    return f"{_PTX_NS}cp_async_wait_all()"


_SHARED = r"\.shared(?:::cta)?"
# The supported instruction forms (opcode with its modifiers -> emitter). Anything else is an
# error at transform time, never silently dropped.
PTX_FORMS: tuple[tuple[str, Any], ...] = (
    (rf"ldmatrix\.sync\.aligned\.m8n8\.x([124])(\.trans)?{_SHARED}\.b16", _ptx_ldmatrix),
    (r"mma\.sync\.aligned\.m16n8k16\.row\.col\.f32\.(f16|bf16)\.(f16|bf16)\.f32", _ptx_mma),
    (rf"cp\.async\.(ca|cg){_SHARED}\.global(?:\.L2::(?:64|128|256)B)?", _ptx_cp_async),
    (r"cp\.async\.commit_group", _ptx_commit),
    (r"cp\.async\.wait_group", _ptx_wait_group),
    (r"cp\.async\.wait_all", _ptx_wait_all),
)
_PTX_FORMS_RE = tuple((re.compile(pattern), emit) for pattern, emit in PTX_FORMS)


def _ptx_call(stmt: _AsmStatement, instr: str) -> str:
    opcode, _, rest = instr.partition(" ")
    for pattern, emit in _PTX_FORMS_RE:
        if m := pattern.fullmatch(opcode):
            return emit(stmt, m, instr, _ptx_args(stmt, rest.strip(), instr))
    shown = re.sub(r"\$(\d+)", r"%\1", instr)
    raise stmt.error(
        f"unsupported instruction {shown!r}: the CPU emulator models only ldmatrix .m8n8 .b16, "
        "mma.sync .m16n8k16 (f16/bf16 -> f32) and cp.async (see tests/cuda_emulator)"
    )


def _asm_replacement(stmt: _AsmStatement) -> str:
    calls = [_ptx_call(stmt, instr) for instr in _ptx_instructions(stmt)]
    if not calls:  # asm volatile("" ::: "memory")
        return f"{_PTX_NS}compiler_barrier()"
    return calls[0] if len(calls) == 1 else f"({', '.join(calls)})"


def _rewrite_asm(source: str) -> str:
    """Replace every ``asm(...)`` statement by the equivalent emulator call expression."""
    code = _blank_comments_and_strings(source)
    pieces: list[str] = []
    last = 0
    for m in _ASM_START_RE.finditer(code):
        if m.start() < last:  # inside an asm statement already consumed
            continue
        try:
            end, stmt = _parse_asm(source, code, m)
            repl = _asm_replacement(stmt)
        except _AsmError as e:
            raise ValueError(str(e)) from None
        # The trailing `;` stays; keep the line count for the compiler's diagnostics.
        pieces += [source[last : m.start()], repl + "\n" * source.count("\n", m.start(), end)]
        last = end
    pieces.append(source[last:])
    return "".join(pieces)


def _wrapper(kernel_name: str, params: Sequence[_Param]) -> str:
    args = ",\n      ".join(
        f"::kg_emu::arg<{p.c_type}>(a[{i}]) /* {p.name} */" for i, p in enumerate(params)
    )
    return f"""
// ---- generated by tests/cuda_emulator: launch wrapper ----
namespace kg_emu_generated {{
static void thunk(void** a) {{
  (void)a;
  ::{kernel_name}(
      {args});
}}
}}  // namespace kg_emu_generated

extern "C" int kg_emulator_launch(void** args, const long long* cfg, long long* stats,
                                  char* note, int notelen, char* err, int errlen) {{
  return ::kg_emu::launch(&kg_emu_generated::thunk, args, cfg, stats, note, notelen, err, errlen);
}}
"""


# --------------------------------------------------------------------------------------------
# Compilation and cache
# --------------------------------------------------------------------------------------------


def _cache_dir() -> Path:
    env = os.environ.get("KG_EMULATOR_CACHE")
    if env:
        d = Path(env)
    else:
        uid = os.getuid() if hasattr(os, "getuid") else "user"
        d = Path(tempfile.gettempdir()) / f"kg_emulator_cache-{uid}"
    d.mkdir(parents=True, exist_ok=True)
    return d


def _compiler() -> str:
    cxx = os.environ.get("KG_EMULATOR_CXX", "g++")
    path = shutil.which(cxx)
    if path is None:
        raise EmulatorUnavailableError(
            f"the CUDA emulator needs a C++20 compiler ({cxx!r} is not on PATH)"
        )
    return path


@functools.lru_cache(maxsize=8)
def _compiler_version(path: str) -> str:
    res = subprocess.run([path, "--version"], capture_output=True, text=True, check=False)
    return res.stdout.splitlines()[0] if res.stdout else ""


def _shim_text() -> str:
    parts = []
    for f in sorted(INCLUDE_DIR.iterdir()):
        if f.is_file():
            parts.append(f"== {f.name}\n{f.read_text()}")
    return "\n".join(parts)


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


@dataclass(frozen=True)
class LaunchStats:
    """What one launch did (summed over its blocks); fields in kg_emulator.h's LaunchStat order."""

    ldmatrix: int = 0  # ldmatrix instructions, one per warp
    ldmatrix_wavefronts: int = 0  # shared-memory wavefronts they took
    ldmatrix_ideal: int = 0  # wavefronts without bank conflicts (one per 8x8 matrix)
    cp_async_global_bytes: int = 0  # global bytes of the cp.async copies issued (src-size)
    first_conflict: str = ""  # the first ldmatrix that took extra wavefronts, or ""

    def __add__(self, other: LaunchStats) -> LaunchStats:
        return LaunchStats(
            self.ldmatrix + other.ldmatrix,
            self.ldmatrix_wavefronts + other.ldmatrix_wavefronts,
            self.ldmatrix_ideal + other.ldmatrix_ideal,
            self.cp_async_global_bytes + other.cp_async_global_bytes,
            self.first_conflict or other.first_conflict,
        )


_NUM_STATS = len(dataclasses.fields(LaunchStats)) - 1  # its counters (kNumStats), not the text


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
        self._launch = lib.kg_emulator_launch
        self._launch.restype = ctypes.c_int
        self._launch.argtypes = [
            ctypes.POINTER(ctypes.c_void_p),
            ctypes.POINTER(ctypes.c_longlong),
            ctypes.POINTER(ctypes.c_longlong),
            ctypes.c_char_p,
            ctypes.c_int,
            ctypes.c_char_p,
            ctypes.c_int,
        ]

    def __repr__(self) -> str:
        return f"EmulatedKernel({self.kernel_name!r}, {self.so_path})"

    def _convert(self, p: _Param, value: Any) -> ctypes._SimpleCData:
        if p.is_pointer:
            if value is None:
                return ctypes.c_void_p(None)
            if not isinstance(value, np.ndarray):
                raise TypeError(
                    f"{self.kernel_name}: argument {p.name!r} ({p.c_type}) needs a numpy array "
                    f"or None, got {type(value).__name__}"
                )
            if p.dtypes is not None and value.dtype.name not in p.dtypes:
                raise TypeError(
                    f"{self.kernel_name}: argument {p.name!r} ({p.c_type}) needs dtype "
                    f"{' or '.join(p.dtypes)}, got {value.dtype}"
                )
            return ctypes.c_void_p(value.ctypes.data)
        if isinstance(value, np.ndarray) and value.ndim == 0:
            value = value[()]
        is_bool = isinstance(value, (bool, np.bool_))
        if p.scalar is ctypes.c_bool:
            if not isinstance(value, (bool, np.bool_, int, np.integer)):
                raise TypeError(f"{self.kernel_name}: {p.name!r} ({p.c_type}) needs a bool")
            return ctypes.c_bool(bool(value))
        if p.scalar in (ctypes.c_float, ctypes.c_double):
            if is_bool or not isinstance(value, (int, float, np.integer, np.floating)):
                raise TypeError(
                    f"{self.kernel_name}: {p.name!r} ({p.c_type}) needs a number, "
                    f"got {type(value).__name__}"
                )
            return p.scalar(float(value))
        if is_bool or not isinstance(value, (int, np.integer)):
            raise TypeError(
                f"{self.kernel_name}: {p.name!r} ({p.c_type}) needs an integer, "
                f"got {type(value).__name__}"
            )
        v = int(value)
        bits = ctypes.sizeof(p.scalar) * 8
        signed = p.scalar(-1).value < 0
        lo, hi = (-(1 << (bits - 1)), (1 << (bits - 1)) - 1) if signed else (0, (1 << bits) - 1)
        if not lo <= v <= hi:
            raise OverflowError(f"{self.kernel_name}: {p.name!r} = {v} does not fit {p.c_type}")
        return p.scalar(v)

    def __call__(
        self,
        grid: Sequence[int] | int = (1, 1, 1),
        block: Sequence[int] | int = (32, 1, 1),
        shared_mem: int = 0,
        args: Sequence[Any] = (),
        *,
        timeout: float | None = None,
    ) -> LaunchStats:
        g, b = _dims(grid, "grid"), _dims(block, "block")
        if b[0] > 1024 or b[1] > 1024 or b[2] > 64:
            raise ValueError(f"block {b} exceeds the CUDA limits (1024, 1024, 64)")
        nthreads = b[0] * b[1] * b[2]
        if nthreads % 32 or nthreads > 1024:
            raise ValueError(
                f"block {b} has {nthreads} threads; the emulator needs a multiple of 32, "
                "at most 1024"
            )
        if g[1] > 65535 or g[2] > 65535 or g[0] > 2**31 - 1:
            raise ValueError(f"grid {g} exceeds the CUDA limits")
        shared_mem = int(shared_mem)
        if not 0 <= shared_mem <= MAX_DYNAMIC_SMEM:
            raise ValueError(f"shared_mem={shared_mem} outside [0, {MAX_DYNAMIC_SMEM}]")
        if len(args) != len(self._params):
            raise TypeError(
                f"{self.kernel_name} takes {len(self._params)} arguments "
                f"({', '.join(n for _, n in self.params)}), got {len(args)}"
            )
        values = [self._convert(p, v) for p, v in zip(self._params, args, strict=True)]
        argv = (ctypes.c_void_p * max(1, len(values)))(*[ctypes.addressof(v) for v in values])
        if timeout is None:
            timeout = float(os.environ.get("KG_EMULATOR_TIMEOUT", DEFAULT_TIMEOUT_S))
        fill = int(os.environ.get("KG_EMULATOR_SMEM_FILL", str(DEFAULT_FILL_BYTE)), 0) & 0xFF
        cfg = (ctypes.c_longlong * 9)(*g, *b, shared_mem, fill, int(timeout * 1000))
        err = ctypes.create_string_buffer(1024)
        note = ctypes.create_string_buffer(256)
        stats = (ctypes.c_longlong * _NUM_STATS)()
        rc = self._launch(argv, cfg, stats, note, len(note), err, len(err))
        if rc != 0:
            raise RuntimeError(f"emulated launch of {self.kernel_name}: {err.value.decode()}")
        return LaunchStats(*stats, first_conflict=note.value.decode())


def _dims(v: Sequence[int] | int, what: str) -> tuple[int, int, int]:
    t = (v,) if isinstance(v, (int, np.integer)) else tuple(v)
    if not 1 <= len(t) <= 3:
        raise ValueError(f"{what} must have 1 to 3 dimensions, got {v!r}")
    t = tuple(int(x) for x in t) + (1,) * (3 - len(t))
    if any(x < 1 for x in t):
        raise ValueError(f"{what} dimensions must be >= 1, got {v!r}")
    return t  # type: ignore[return-value]


def build_kernel(
    source: str, kernel_name: str, params: Sequence[tuple[str, str]]
) -> EmulatedKernel:
    """Compile ``kernel_name`` from CUDA ``source`` for the CPU (cached) and return a launcher.

    ``params`` are the kernel's ``(c_type, name)`` parameters, in order. Raises
    :class:`EmulatorUnavailableError` without a compiler, ``RuntimeError`` (with the compiler's
    output) when the source does not compile, ``ValueError`` for unsupported parameters or
    source constructs (e.g. an inline-PTX instruction the emulator does not model).
    """
    if not _IDENT_RE.match(kernel_name):
        raise ValueError(f"bad kernel name {kernel_name!r}")
    parsed = [_parse_param(t, n) for t, n in params]
    cxx = _compiler()
    cpp = (
        f'#line 1 "{kernel_name}.cu"\n'
        + transform_source(source)
        + '\n#line 1 "kg_emulator_wrapper.cpp"\n'
        + _wrapper(kernel_name, parsed)
    )
    flags = [*CXX_FLAGS, "-include", str(SHIM), "-I", str(INCLUDE_DIR)]
    key = hashlib.sha256(
        "\0".join(
            [_CODEGEN_VERSION, _compiler_version(cxx), " ".join(CXX_FLAGS), _shim_text(), cpp]
        ).encode()
    ).hexdigest()[:32]
    cache = _cache_dir()
    so_path = cache / f"{kernel_name}-{key}.so"
    compile_seconds = 0.0
    if not so_path.exists():
        cpp_path = cache / f"{kernel_name}-{key}.cpp"
        _write_atomic(cpp_path, cpp.encode())
        tmp_so = so_path.with_name(f".{so_path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        t0 = time.perf_counter()
        res = subprocess.run(
            [cxx, *flags, "-o", str(tmp_so), str(cpp_path)],
            capture_output=True,
            text=True,
            check=False,
        )
        compile_seconds = time.perf_counter() - t0
        if res.returncode != 0:
            tmp_so.unlink(missing_ok=True)
            raise RuntimeError(
                f"g++ failed to compile kernel {kernel_name!r} for the CPU emulator "
                f"(source: {cpp_path}):\n{res.stdout}{res.stderr}"
            )
        os.replace(tmp_so, so_path)
    with _loaded_lock:
        lib = _loaded.get(str(so_path))
        if lib is None:
            lib = ctypes.CDLL(str(so_path))
            _loaded[str(so_path)] = lib
    return EmulatedKernel(lib, kernel_name, parsed, so_path, compile_seconds)
