"""CUDA source -> C++ for the emulator: dynamic shared memory and inline PTX rewritten.

:func:`transform_source` rewrites ``extern __shared__ T NAME[];`` into a pointer to the emulated
buffer and every ``asm`` statement into a call into ``include/kg_ptx.h`` (an instruction outside
:data:`PTX_FORMS` is an :class:`~kernelgen.errors.EmulatorSourceError`, never silently dropped).
:func:`transform_preprocessed` applies it to the output of ``g++ -E`` (what
:func:`~kernelgen.emulator.build_kernel` compiles), only to the text of the kernel's own files:
asm inside macros is rewritten where the macros are used, never where they are defined.
Line counts are kept everywhere so that compiler diagnostics point at the source lines.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from kernelgen.errors import EmulatorSourceError

__all__ = ["PTX_FORMS", "transform_preprocessed", "transform_source"]

_IDENT_RE = re.compile(r"^[A-Za-z_][A-Za-z_0-9]*$")

# --------------------------------------------------------------------------------------------
# Source transformation
# --------------------------------------------------------------------------------------------

# `__shared__` is `static` once kg_emulator.h's macros are expanded (the preprocessed source).
_DYN_SMEM_RE = re.compile(r"\bextern\s+(?:__shared__|static)\s+(?P<body>[^;{}\[\]]+?)\[\s*\]\s*;")
_ALIGN_RE = re.compile(
    r"__align__\s*\(\s*\w+\s*\)|alignas\s*\(\s*\w+\s*\)"
    r"|__attribute__\s*\(\((?:[^()]|\([^()]*\))*\)\)"
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
        elif c == "'" and _is_digit_separator(src, i):
            i += 1
        elif c in "\"'":
            j = i + 1
            while j < n and src[j] != c:
                j += 2 if src[j] == "\\" else 1
            out[i + 1 : min(j, n)] = " " * (min(j, n) - i - 1)
            i = j + 1
        else:
            i += 1
    return "".join(out)


def _is_digit_separator(src: str, i: int) -> bool:
    """Whether the ``'`` at ``src[i]`` separates digits (C++14 ``48'000``, ``0xFF'FF``) rather
    than opening a character literal (``'a'``, ``u8'a'``, ``L'a'``): it does when the token it
    ends is a number, i.e. starts with a digit (or ``.digit``)."""
    j = i
    while j > 0 and (src[j - 1].isalnum() or src[j - 1] in "_.'"):
        j -= 1
    return j < i and (src[j].isdigit() or (src[j] == "." and src[j + 1 : j + 2].isdigit()))


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

    Works on CUDA text as written (macros not expanded); :func:`transform_preprocessed` is the
    path of compiled kernels. Line numbers are kept. Raises
    :class:`~kernelgen.errors.EmulatorSourceError` for a declaration or asm it cannot handle.
    """
    return _rewrite_asm(_rewrite_dynamic_smem(source))


# `# 12 "file.cu" 1 3`: the lines after it come from line 12 of file.cu; flag 3 marks a system
# header.
_LINEMARKER_RE = re.compile(r'# \d+ "((?:[^"\\]|\\.)*)"((?: \d+)*)\s*')
_SEGMENT_SEP = "\n// ---- kg_emulator: segment boundary ----\n"


def transform_preprocessed(text: str, library_dirs: tuple[str, ...] = ()) -> str:
    """:func:`transform_source` applied to the output of ``g++ -E``: only to the lines that come
    from the kernel's own files, not from system headers (linemarker flag 3), built-ins or files
    under ``library_dirs`` (the emulator's headers, whose macros and code are its own).

    Macros are expanded by then, so an asm statement in a multi-line ``#define`` is rewritten
    where the macro is used (with its arguments, ``#N`` string pieces included), and one in a
    macro that is never used, or in an ``#if`` branch not taken, is never looked at (as on the
    GPU, where it never reaches ptxas)."""
    segments: list[tuple[bool, str, list[str]]] = [(True, "", [])]  # (own, marker, lines)
    for line in text.splitlines(keepends=True):
        m = _LINEMARKER_RE.fullmatch(line)
        if m is None:
            segments[-1][2].append(line)
            continue
        name, flags = m.group(1), m.group(2).split()
        library = any(name.startswith(d.rstrip("/") + "/") for d in library_dirs)
        segments.append((not ("3" in flags or name.startswith("<") or library), line, []))
    own = [("".join(lines)) for is_own, _, lines in segments if is_own]
    done = iter(transform_source(_SEGMENT_SEP.join(own)).split(_SEGMENT_SEP))
    return "".join(
        marker + (next(done) if is_own else "".join(lines)) for is_own, marker, lines in segments
    )


def _rewrite_dynamic_smem(source: str) -> str:
    code = _blank_comments_and_strings(source)  # same offsets as `source`
    pieces: list[str] = []
    last = 0
    for k, m in enumerate(_DYN_SMEM_RE.finditer(code)):
        body = _ALIGN_RE.sub(" ", source[m.start("body") : m.end("body")])
        words = body.split()
        if len(words) < 2 or not _IDENT_RE.match(words[-1]):
            raise EmulatorSourceError(
                f"cannot parse dynamic shared memory declaration {m.group()!r}"
            )
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
    if re.search(r"\bextern\s+(?:__shared__|static)\b", _blank_comments_and_strings(out)):
        raise EmulatorSourceError("unrecognised `extern __shared__` declaration left in the source")
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


class _AsmError(EmulatorSourceError):
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
        """An f32 destination: "=f" (a float) or "=r" (its bits in a 32-bit integer)."""
        return f"({self.operand(ref, 'fr', True, role).expr})"

    def read_f32(self, ref: int, role: str) -> str:
        """An f32 source: "f" (converted to float) or "r" (a 32-bit value holding its bits)."""
        op = self.operand(ref, "fr", False, role)
        if op.kind == "r":
            return f"{_PTX_NS}f32_bits({op.expr})"
        return f"static_cast<float>({op.expr})"

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


_LDMATRIX_REQUIRED = {"sync", "aligned", "m8n8", "b16"}


def _ldmatrix_qualifiers(stmt: _AsmStatement, qualifiers: str, instr: str) -> tuple[int, bool]:
    """(matrices, .trans) of ``ldmatrix`` qualifiers written in any order: the PTX ISA's
    ``.sync.aligned.m8n8.x4.trans.shared.b16``, CUTLASS's ``.sync.aligned.x4.trans.m8n8...``
    (ptxas takes both) and others; each exactly once."""
    words = qualifiers.split(".")[1:]
    nums = [w for w in words if w in ("x1", "x2", "x4")]
    spaces = [w for w in words if w in ("shared", "shared::cta")]
    known = _LDMATRIX_REQUIRED | {"x1", "x2", "x4", "trans", "shared", "shared::cta"}
    unknown = [w for w in words if w not in known]
    if unknown or len(set(words)) != len(words) or len(nums) != 1 or len(spaces) != 1:
        raise stmt.error(
            f"unsupported ldmatrix form {instr.split(' ')[0]!r}: needs .sync .aligned .m8n8 "
            ".x1/.x2/.x4 .shared .b16 (optional .trans), each once"
            + (f"; unknown {', '.join('.' + w for w in unknown)}" if unknown else "")
        )
    missing = _LDMATRIX_REQUIRED - set(words)
    if missing:
        raise stmt.error(f"{instr.split(' ')[0]!r} lacks .{', .'.join(sorted(missing))}")
    return int(nums[0][1]), "trans" in words


def _ptx_ldmatrix(stmt: _AsmStatement, m: re.Match[str], instr: str, args: list[tuple]) -> str:
    n, trans = _ldmatrix_qualifiers(stmt, m.group(1), instr)
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


def _cp_size(stmt: _AsmStatement, arg: tuple, cop: str, instr: str) -> str:
    """The cp-size template argument: an immediate (checked here) or an "n" operand, a constant
    expression the C++ side checks (``static_assert``)."""
    if arg[0] == "imm":
        if arg[1] not in ((16,) if cop == "cg" else (4, 8, 16)):
            raise stmt.error(f"{instr!r}: cp-size {arg[1]} is not allowed with .{cop}")
        return str(arg[1])
    return f"({stmt.operand(arg[1], 'ni', False, 'cp.async cp-size').expr})"


def _ptx_cp_async(stmt: _AsmStatement, m: re.Match[str], instr: str, args: list[tuple]) -> str:
    _expect(stmt, instr, args, "addr addr val" if len(args) == 3 else "addr addr val val")
    size = _cp_size(stmt, args[2], m.group(1), instr)
    dst = _offset(stmt.read_b32(args[0][1], "cp.async destination"), args[0][2])
    src = stmt.read_global(args[1][1], "cp.async source")
    if args[1][2]:
        src = f"({src} + {args[1][2]})"
    call = f"{_PTX_NS}cp_async<{size}, {str(m.group(1) == 'cg').lower()}>({dst}, {src}"
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
    (r"ldmatrix((?:\.[A-Za-z0-9_:]+)+)", _ptx_ldmatrix),
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
        "mma.sync .m16n8k16 (f16/bf16 -> f32) and cp.async (docs/emulator.md)"
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
            raise EmulatorSourceError(str(e)) from None
        # The trailing `;` stays; keep the line count for the compiler's diagnostics.
        pieces += [source[last : m.start()], repl + "\n" * source.count("\n", m.start(), end)]
        last = end
    pieces.append(source[last:])
    return "".join(pieces)
