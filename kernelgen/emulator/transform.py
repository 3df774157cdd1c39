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
from dataclasses import dataclass, field
from typing import Any

from kernelgen.errors import EmulatorSourceError

__all__ = ["PTX_FORMS", "transform_preprocessed", "transform_source"]

_IDENT_RE = re.compile(r"^[A-Za-z_][A-Za-z_0-9]*$")

# --------------------------------------------------------------------------------------------
# Source transformation
# --------------------------------------------------------------------------------------------

# `__shared__` reads `__kg_shared__` in the preprocessed source (kg_emulator.h defines it so when
# KG_EMULATOR_PREPROCESS is set), `static` in older translations.
_SHARED_KW = r"(?:__shared__|__kg_shared__|static)"
_DYN_SMEM_RE = re.compile(rf"\bextern\s+{_SHARED_KW}\s+(?P<body>[^;{{}}\[\]]+?)\[\s*\]\s*;")
_STATIC_SMEM_RE = re.compile(r"\b(?:__shared__|__kg_shared__)\b")
_ALIGNED_RE = re.compile(
    r"__attribute__\s*\(\(\s*aligned\s*\((?P<a>[^()]*)\)\s*\)\)"
    r"|(?:alignas|__align__)\s*\((?P<b>[^()]*)\)"
)
# `type name[dims]` of a static shared declaration (the type ends before the last identifier).
_SHARED_DECL_RE = re.compile(
    r"(?P<type>.*[\s*&>)\]])(?P<name>[A-Za-z_]\w*)\s*(?P<dims>(?:\[[^\[\]]*\]\s*)*)", re.S
)
_CLUSTER_DIMS_RE = re.compile(r"\b__kg_cluster_dims__\s*\(")
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
    return _rewrite_cluster_dims(_rewrite_asm(_rewrite_static_smem(_rewrite_dynamic_smem(source))))


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
        marker + (next(done) if is_own else "".join(lines).replace("__kg_shared__", "static"))
        for is_own, marker, lines in segments
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
                f"static thread_local {ctype}* {name} = nullptr; "
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
    if re.search(rf"\bextern\s+{_SHARED_KW}\b", _blank_comments_and_strings(out)):
        raise EmulatorSourceError("unrecognised `extern __shared__` declaration left in the source")
    return out


def _statement_start(code: str, pos: int) -> int:
    """Offset after the `;`, `{` or `}` before ``pos`` (comment/string-blanked code)."""
    i = pos
    while i > 0 and code[i - 1] not in ";{}":
        i -= 1
    return i


def _split_declarators(text: str) -> list[str]:
    """``text`` split at the commas outside brackets and template argument lists."""
    parts, depth, last = [], 0, 0
    for i, ch in enumerate(text):
        if ch in "([{<":
            depth += 1
        elif ch in ")]}>":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(text[last:i])
            last = i + 1
    return [*parts, text[last:]]


_DECLARATOR_RE = re.compile(
    r"\s*(?P<ptr>[*&\s]*)(?P<name>[A-Za-z_]\w*)\s*(?P<dims>(?:\[[^\[\]]*\]\s*)*)"
)


def _static_smem_declaration(source: str, start: int, end: int, k: int) -> str | None:
    """The rewrite of the function-scope static shared declaration ``source[start:end]`` (its
    ``;`` excluded) into references into the block's static arena (one per declarator), or None
    when it cannot be read (then it stays ordinary static storage)."""
    text = source[start:end]
    aligns = [m.group("a") or m.group("b") for m in _ALIGNED_RE.finditer(text)]
    text = _ALIGN_RE.sub(" ", text)
    text = _STATIC_SMEM_RE.sub(" ", text)
    text = re.sub(r"\bstatic\b", " ", text).strip()
    blanked = _blank_comments_and_strings(text)
    if "=" in blanked or blanked != text:
        return None  # an initializer, or comments inside
    first, *others = _split_declarators(text)
    m = _SHARED_DECL_RE.fullmatch(first)
    if m is None or not m.group("type").strip():
        return None
    base = m.group("type").rstrip(" *&")
    declarators = [(m.group("type").strip(), m.group("name"), m.group("dims").strip())]
    for piece in others:
        d = _DECLARATOR_RE.fullmatch(piece)
        if d is None:
            return None
        declarators.append((f"{base} {d.group('ptr').strip()}", d.group("name"), d.group("dims")))
    out = []
    for j, (ctype, name, dims) in enumerate(declarators):
        t, site = f"kg_shared_t_{k}_{j}", f"kg_shared_site_{k}_{j}"
        align = f"alignof({t})"
        for a in aligns:
            align = f"(({align}) > ({a}) ? ({align}) : ({a}))"
        out.append(
            f"using {t} = {ctype} {dims.strip()}; static char {site}; "
            f"{t}& {name} = *reinterpret_cast<{t}*>(::kg_emu::static_smem_site("
            f"&{site}, sizeof({t}), {align}))"
        )
    return "; ".join(out)


def _rewrite_static_smem(source: str) -> str:
    """``__shared__`` declarations left after :func:`_rewrite_dynamic_smem`: in a function, a
    reference into the block's static arena (``kg_emu::static_smem_site``: one per block, in
    the shared window, so that the blocks of a cluster each have their own and
    ``__cvta_generic_to_shared`` maps them); at namespace scope (or not one plain declarator),
    ordinary ``static`` storage (one per process)."""
    code = _blank_comments_and_strings(source)
    pieces: list[str] = []
    last = 0
    for k, m in enumerate(_STATIC_SMEM_RE.finditer(code)):
        if m.start() < last:
            continue
        start = _statement_start(code, m.start())
        end = code.find(";", m.end())
        repl = None
        if end >= 0 and not _at_namespace_scope(code, m.start()):
            repl = _static_smem_declaration(source, start, end, k)
        if repl is None:
            pieces += [source[last : m.start()], "static"]
            last = m.end()
            continue
        pieces += [source[last:start], repl + "\n" * source.count("\n", start, end)]
        last = end
    pieces.append(source[last:])
    return "".join(pieces)


def _rewrite_cluster_dims(source: str) -> str:
    """``__cluster_dims__(x, y, z)`` (``__kg_cluster_dims__`` once preprocessed) on a kernel:
    the attribute goes, and a registration of the kernel's cluster shape (read by the launch)
    is added at the end."""
    code = _blank_comments_and_strings(source)
    pieces: list[str] = []
    regs: list[str] = []
    last = 0
    for m in _CLUSTER_DIMS_RE.finditer(code):
        close = _closing(code, m.end() - 1)
        dims = [source[a:b].strip() for a, b in _split_top(code, m.end(), close, ",")]
        after = re.compile(r"([A-Za-z_]\w*)\s*\(").search(code, close + 1)
        if not 1 <= len(dims) <= 3 or not all(dims) or after is None:
            raise EmulatorSourceError(
                f"cannot read the kernel of __cluster_dims__({source[m.end() : close]})"
            )
        dims += ["1"] * (3 - len(dims))
        regs.append(
            f"static const bool kg_cluster_dims_{len(regs)} = ::kg_emu::register_cluster_dims("
            f'"{after.group(1)}", {", ".join(f"({d})" for d in dims)});'
        )
        pieces += [source[last : m.start()], "\n" * source.count("\n", m.start(), close)]
        last = close + 1
    if not regs:
        return source
    pieces.append(source[last:])
    return "".join(pieces) + "\n" + "\n".join(regs) + "\n"


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
    # PTX registers declared in a `{ .reg ... }` block: name -> "pred" or "b32"
    locals: dict[str, str] = field(default_factory=dict)
    labels: list[str] = field(default_factory=list)  # labels of the block (branch targets)

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

    def u32(self, arg: tuple, role: str) -> str:
        """A 32-bit source: an immediate, a "r" (or constant "n") operand or a local .b32."""
        if arg[0] == "imm":
            return str(arg[1])
        if arg[0] == "reg":
            op = self.operand(arg[1], "rnih", False, role)
            return f"({op.expr})" if op.kind in "ni" else f"{_PTX_NS}b32({op.expr})"
        if arg[0] == "local" and self.locals[arg[1]] == "b32":
            return _local_name(arg[1])
        if arg[0] == "sreg":
            return f"{_PTX_NS}sreg_{arg[1]}({arg[2]})"
        raise self.error(f"{role} must be a 32-bit register or an immediate")

    def u64(self, arg: tuple, role: str) -> str:
        """A 64-bit source: a "l" operand or an immediate."""
        if arg[0] == "imm":
            return f"{arg[1]}ull"
        if arg[0] == "reg":
            return f"static_cast<uint64_t>({self.operand(arg[1], 'l', False, role).expr})"
        raise self.error(f'{role} must be a 64-bit ("l") operand')

    def out32(self, arg: tuple, role: str) -> str:
        """A 32-bit destination: a "=r" operand, a local .b32 or the sink `_`."""
        if arg[0] == "reg":
            return self.write_b32(arg[1], role)
        if arg[0] == "local" and self.locals[arg[1]] == "b32":
            return _local_name(arg[1])
        if arg[0] == "sink":
            return _SINK32
        raise self.error(f"{role} must be a 32-bit register or _")

    def out64(self, arg: tuple, role: str) -> str | None:
        """A 64-bit destination: a "=l" operand, or None for the sink `_`."""
        if arg[0] == "sink":
            return None
        if arg[0] == "reg":
            return f"({self.operand(arg[1], 'l', True, role).expr})"
        raise self.error(f'{role} must be a 64-bit ("=l") operand or _')

    def pred(self, arg: tuple, role: str, write: bool = False) -> str:
        """A predicate: a local .pred (or, read only, the immediate 0 or 1)."""
        if arg[0] == "local" and self.locals[arg[1]] == "pred":
            return _local_name(arg[1])
        if not write and arg[0] == "imm" and arg[1] in (0, 1):
            return "true" if arg[1] else "false"
        raise self.error(
            f"{role} must be a predicate declared in the asm block (`.reg .pred p;`)"
            + ("" if write else " or the immediate 0 or 1")
        )

    def shared_addr(self, arg: tuple, role: str) -> str:
        """A `[%N]` / `[%N+off]` shared-memory address held in a "r" operand."""
        if arg[0] != "addr":
            raise self.error(f"{role} must be a [register] address")
        return _offset(self.read_b32(arg[1], role), arg[2])

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
        if tok == "%=":  # a number unique to the asm statement (for labels)
            return str(stmt.line)
        if m.group("num") is not None:
            return f"${m.group('num')}"
        if m.group("name") is not None:
            if m.group("name") not in stmt.names:
                raise stmt.error(f"unknown named operand {tok}")
            return f"${stmt.names[m.group('name')]}"
        raise stmt.error(f"unsupported operand reference {tok!r}")

    return re.sub(r"%%|%(?P<num>\d+)|%\[(?P<name>\w+)\]|%.?", ref, stmt.template)


# Special registers (`mov.u32 d, %name`): name -> whether it has .x/.y/.z components.
_SPECIAL_REGISTERS = {
    "tid": True,
    "ntid": True,
    "ctaid": True,
    "nctaid": True,
    "laneid": False,
    "warpid": False,
    "nwarpid": False,
    "clusterid": True,
    "nclusterid": True,
    "cluster_ctaid": True,
    "cluster_nctaid": True,
    "cluster_ctarank": False,
    "cluster_nctarank": False,
    "dynamic_smem_size": False,
}
_SREG_NAMES = ", ".join("%" + k for k in _SPECIAL_REGISTERS)
_SREG_RE = re.compile(r"%(\w+)(?:\.([xyz]))?")
_SINK32 = "kg_sink32"
_LABEL_RE = re.compile(r"[A-Za-z_$][\w$]*")
_BRA_RE = re.compile(r"bra(?:\.uni)?\s+([A-Za-z_$][\w$]*)")
_REG_DECL_RE = re.compile(r"\.reg\s+\.(pred|b32|u32|s32)\s+(.+)")
_LOCAL_RE = re.compile(r"%?[A-Za-z_][A-Za-z_0-9]*")


def _local_name(name: str) -> str:
    return "kg_ptx_" + name.replace("%", "pct_").replace("$", "dollar_")


def _ptx_instructions(stmt: _AsmStatement) -> list[tuple[str, str]]:
    """(guard, instruction) pairs of the template: single-spaced, comments, ``;`` and the braces
    of a ``{ ... }`` block removed, ``.reg`` declarations moved into ``stmt.locals``; the guard
    is ``""``, ``"p"`` or ``"!p"`` for ``@p`` / ``@!p``."""
    text = re.sub(r"//[^\n]*", " ", _resolve_operand_refs(stmt))
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    parts: list[str] = []
    current: list[str] = []
    vector_depth = block_depth = 0
    for ch in text:
        at_start = not "".join(current).strip()
        if ch == "{" and vector_depth == 0 and at_start:
            block_depth += 1
        elif ch == "}" and vector_depth == 0:
            if block_depth == 0 or not at_start:
                raise stmt.error("unbalanced braces in the asm block (a missing `;`?)")
            block_depth -= 1
        elif ch == "{":
            vector_depth += 1
            current.append(ch)
        elif ch == "}":
            vector_depth -= 1
            current.append(ch)
        elif ch == ";" and vector_depth == 0:
            parts.append("".join(current))
            current = []
        elif ch == ":" and vector_depth == 0 and _LABEL_RE.fullmatch("".join(current).strip()):
            parts.append(":" + "".join(current).strip())  # a label
            current = []
        else:
            current.append(ch)
    if block_depth or vector_depth or "".join(current).strip():
        raise stmt.error("unbalanced braces or a missing `;` in the asm text")
    out: list[tuple[str, str]] = []
    for part in parts:
        instr = " ".join(part.split())
        if not instr:
            continue
        if instr.startswith(":"):
            if instr[1:] in stmt.labels:
                raise stmt.error(f"label {instr[1:]} defined twice")
            stmt.labels.append(instr[1:])
            out.append(("", instr))
            continue
        if m := _REG_DECL_RE.fullmatch(instr):
            for name in (n.strip() for n in m.group(2).split(",")):
                if not _LOCAL_RE.fullmatch(name) or name in stmt.locals:
                    raise stmt.error(f"bad register declaration {instr!r}")
                stmt.locals[name] = "pred" if m.group(1) == "pred" else "b32"
            continue
        guard = ""
        if m := re.fullmatch(r"@(!?)\s*(%?\w+)\s+(.*)", instr):
            if stmt.locals.get(m.group(2)) != "pred":
                raise stmt.error(f"guard @{m.group(1)}{m.group(2)} is not a declared predicate")
            guard, instr = m.group(1) + m.group(2), m.group(3)
        out.append((guard, instr))
    return out


def _ptx_args(stmt: _AsmStatement, text: str, instr: str) -> list[tuple]:
    """Parse a PTX operand list: ``{$0, $1}`` -> ("vec", [0, 1]), ``[$4]`` / ``[$4+16]`` ->
    ("addr", 4, 16), ``$2`` -> ("reg", 2), ``16`` -> ("imm", 16)."""
    args: list[tuple] = []
    if not text:
        return args
    for s, e in _split_top(text, 0, len(text), ","):
        a = text[s:e].strip()
        if "|" in a and a.count("|") == 1:
            first, second = a.split("|")
            args.append(("pair", *_ptx_args(stmt, first, instr), *_ptx_args(stmt, second, instr)))
        elif a == "_":
            args.append(("sink",))
        elif a in stmt.locals:
            args.append(("local", a))
        elif m := re.fullmatch(r"\[\s*\$(\d+)\s*,\s*\{([^{}]*)\}\s*\]", a):
            coords = [_ptx_args(stmt, c.strip(), instr)[0] for c in m.group(2).split(",")]
            args.append(("tmap", int(m.group(1)), coords))
        elif re.fullmatch(r"-\d+", a):
            args.append(("imm", int(a)))
        elif (m := _SREG_RE.fullmatch(a)) and m.group(1) in _SPECIAL_REGISTERS:
            dims = _SPECIAL_REGISTERS[m.group(1)]
            if (m.group(2) is None) == dims:
                raise stmt.error(
                    f"special register {a} "
                    + ("needs .x, .y or .z" if dims else "takes no .x/.y/.z")
                )
            args.append(("sreg", m.group(1), "xyz".index(m.group(2)) if dims else 0))
        elif re.fullmatch(r"%[\w.]+", a):
            shown = re.sub(r"\$(\d+)", r"%\1", instr)
            raise stmt.error(
                f"unsupported instruction {shown!r}: {a} is not a register declared in the asm "
                f"block nor a special register the emulator models ({_SREG_NAMES})"
            )
        elif m := re.fullmatch(r"\{\s*(\$\d+(?:\s*,\s*\$\d+)*)\s*\}", a):
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


def _ldmatrix_qualifiers(
    stmt: _AsmStatement, qualifiers: str, instr: str, name: str = "ldmatrix"
) -> tuple[int, bool]:
    """(matrices, .trans) of ``ldmatrix`` / ``stmatrix`` qualifiers written in any order: the PTX
    ISA's ``.sync.aligned.m8n8.x4.trans.shared.b16``, CUTLASS's ``.sync.aligned.x4.trans.m8n8...``
    (ptxas takes both) and others; each exactly once. Without ``.shared{::cta}`` the address is
    generic (:func:`_generic_address`)."""
    words = qualifiers.split(".")[1:]
    nums = [w for w in words if w in ("x1", "x2", "x4")]
    spaces = [w for w in words if w in ("shared", "shared::cta")]
    known = _LDMATRIX_REQUIRED | {"x1", "x2", "x4", "trans", "shared", "shared::cta"}
    unknown = [w for w in words if w not in known]
    if unknown or len(set(words)) != len(words) or len(nums) != 1 or len(spaces) > 1:
        raise stmt.error(
            f"unsupported {name} form {instr.split(' ')[0]!r}: needs .sync .aligned .m8n8 "
            ".x1/.x2/.x4 .b16 (optional .trans and .shared), each once"
            + (f"; unknown {', '.join('.' + w for w in unknown)}" if unknown else "")
        )
    missing = _LDMATRIX_REQUIRED - set(words)
    if missing:
        raise stmt.error(f"{instr.split(' ')[0]!r} lacks .{', .'.join(sorted(missing))}")
    return int(nums[0][1]), "trans" in words


def _generic_address(qualifiers: str) -> bool:
    """Whether an ldmatrix / stmatrix without a state space takes a generic address."""
    return not {"shared", "shared::cta"} & set(qualifiers.split(".")[1:])


def _matrix_address(stmt: _AsmStatement, arg: tuple, generic: bool, role: str) -> str:
    """The shared address of an ldmatrix / stmatrix ``[p]``: a "r" .shared address, or with a
    generic address (no state space) a "l" pointer converted like __cvta_generic_to_shared."""
    if not generic:
        return _offset(stmt.read_b32(arg[1], role), arg[2])
    ptr = stmt.read_global(arg[1], role)
    if arg[2]:
        ptr = f"({ptr} + {arg[2]})"
    return f"{_PTX_NS}shared_address_of({ptr})"


def _ptx_ldmatrix(stmt: _AsmStatement, m: re.Match[str], instr: str, args: list[tuple]) -> str:
    n, trans = _ldmatrix_qualifiers(stmt, m.group(1), instr)
    generic = _generic_address(m.group(1))
    _expect(stmt, instr, args, f"vec{n} addr")
    regs = [stmt.write_b32(r, "ldmatrix destination") for r in args[0][1]]
    addr = _matrix_address(stmt, args[1], generic, "ldmatrix address")
    return f"{_PTX_NS}ldmatrix<{n}, {str(trans).lower()}>({addr}, {', '.join(regs)})"


def _ptx_stmatrix(stmt: _AsmStatement, m: re.Match[str], instr: str, args: list[tuple]) -> str:
    n, trans = _ldmatrix_qualifiers(stmt, m.group(1), instr, "stmatrix")
    generic = _generic_address(m.group(1))
    _expect(stmt, instr, args, f"addr vec{n}")
    regs = [stmt.read_b32(r, "stmatrix source") for r in args[1][1]]
    addr = _matrix_address(stmt, args[0], generic, "stmatrix address")
    return f"{_PTX_NS}stmatrix<{n}, {str(trans).lower()}>({addr}, {', '.join(regs)})"


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


# ---- Hopper (sm_90a): wgmma, mbarrier, TMA and helpers (include/kg_wgmma.h, kg_mbarrier.h,
# kg_tma.h); the forms are listed in docs/emulator.md.


def _kinds(args: list[tuple]) -> str:
    return " ".join(a[0] + (str(len(a[1])) if a[0] == "vec" else "") for a in args)


def _shape_error(stmt: _AsmStatement, instr: str, args: list[tuple], want: str) -> _AsmError:
    return stmt.error(f"{instr!r}: expected operands {want!r}, got {_kinds(args)!r}")


def _checked_immediate(stmt: _AsmStatement, arg: tuple, role: str, allowed: tuple[int, ...]) -> str:
    if arg[0] == "imm" and arg[1] not in allowed:
        raise stmt.error(f"{role} is {arg[1]}; allowed: {', '.join(map(str, allowed))}")
    return stmt.immediate(arg, role)


_WGMMA_ELEMS = {"f16": "f16", "bf16": "bf16", "e4m3": "e4m3", "e5m2": "e5m2"}


def _ptx_wgmma(stmt: _AsmStatement, m: re.Match[str], instr: str, args: list[tuple]) -> str:
    n, k, dtype, a_type, b_type = (
        int(m.group(1)),
        int(m.group(2)),
        m.group(3),
        m.group(4),
        m.group(5),
    )
    opcode = instr.split(" ")[0]
    if n % 8 or not 8 <= n <= 256:
        raise stmt.error(f"{opcode!r}: N={n} is not a multiple of 8 in [8, 256]")
    fp8 = a_type in ("e4m3", "e5m2")
    if fp8 != (b_type in ("e4m3", "e5m2")) or (not fp8 and a_type != b_type):
        raise stmt.error(f"{instr!r}: A and B must have the same type (or both fp8 types)")
    if k != (32 if fp8 else 16) or (dtype == "f16" and a_type == "bf16"):
        raise stmt.error(
            f"unsupported wgmma form {opcode!r}: the emulator models k16 with f16/bf16 inputs (f32 "
            "accumulators, f16 ones for f16 inputs) and k32 with e4m3/e5m2 inputs (f32 or f16 "
            "accumulators)"
        )
    nregs = n // 2 if dtype == "f32" else n // 4
    register_a = len(args) > 1 and args[1][0] == "vec"
    imms = 2 + (0 if fp8 else 1 if register_a else 2)  # scales, then transposes (16-bit only)
    want = f"vec{nregs} " + ("vec4 reg" if register_a else "reg reg") + " pred" + " imm" * imms
    if len(args) != len(want.split()) or args[0][0] != "vec" or len(args[0][1]) != nregs:
        raise _shape_error(stmt, instr, args, want)
    d = []
    kinds = "fr" if dtype == "f32" else "r"
    for ref in args[0][1]:
        op = stmt.operand(ref, kinds, True, "wgmma accumulator")
        if not op.readable:
            raise stmt.error(
                f"wgmma accumulator {op.describe()} is read and written by wgmma: declare it "
                + ('"+f"' if dtype == "f32" else '"+r" (a .f16x2 register)')
            )
        d.append(f"({op.expr})")
    rest = args[3:]
    if rest[0][0] == "reg" and stmt.operands[rest[0][1]].kind in "ni":  # a constant
        scale_d = f"({stmt.immediate(rest[0], 'wgmma scale-d')}) != 0"
    else:
        scale_d = stmt.pred(rest[0], "wgmma scale-d")
    scales = [_checked_immediate(stmt, a, "wgmma imm-scale", (1, -1)) for a in rest[1:3]]
    trans = [_checked_immediate(stmt, a, "wgmma imm-trans", (0, 1)) for a in rest[3:]]
    if fp8:  # no transposes: 8-bit operands are K-major
        trans = ["0"] if register_a else ["0", "0"]
    if not fp8 and dtype == "f32":  # the 16-bit forms' own entry points
        targs = f"{_PTX_NS}Elem::{a_type}, {n}"
    else:
        ns = f"{_PTX_NS}WElem::"
        targs = f"{ns}{a_type}, {ns}{b_type}, {n}, {str(dtype == 'f16').lower()}"
    if register_a:
        if len(args[1][1]) != 4:
            raise _shape_error(stmt, instr, args, want)
        a = [f"({stmt.operand(r, 'r', False, 'wgmma A').expr})" for r in args[1][1]]
        b = stmt.u64(args[2], "wgmma b-desc")
        call_args = [*a, b, scale_d, *scales, *trans, *d]
        return f"{_PTX_NS}wgmma_rs<{targs}>({', '.join(call_args)})"
    descs = [stmt.u64(args[1], "wgmma a-desc"), stmt.u64(args[2], "wgmma b-desc")]
    call_args = [*descs, scale_d, *scales, *trans, *d]
    return f"{_PTX_NS}wgmma_ss<{targs}>({', '.join(call_args)})"


def _ptx_cvt_fp8(stmt: _AsmStatement, m: re.Match[str], instr: str, args: list[tuple]) -> str:
    """cvt.rn.satfinite{.relu}.{e4m3x2,e5m2x2}.{f32,f16x2}, cvt.rn{.relu}.f16x2.{e4m3x2,e5m2x2}
    and cvt.rn{.relu}{.satfinite}.{f16x2,bf16x2}.f32."""
    relu = str(m.group("relu") is not None).lower()
    dst, src = m.group("dst"), m.group("src")
    pair = src == "f32"
    if len(args) != (3 if pair else 2) or args[0][0] != "reg":
        raise _shape_error(stmt, instr, args, "d a b" if pair else "d a")
    d = f"({stmt.operand(args[0][1], 'hr', True, 'cvt destination').expr})"
    if pair:
        a = [stmt.read_f32(x[1], "cvt source") if x[0] == "reg" else None for x in args[1:]]
        if None in a:
            raise stmt.error(f"{instr!r}: the sources must be f32 registers")
        if dst in ("f16x2", "bf16x2"):
            sat = str(m.group("sat") is not None).lower()
            return f"{_PTX_NS}cvt_{dst}_f32<{relu}, {sat}>({d}, {a[0]}, {a[1]})"
        return (
            f"{_PTX_NS}cvt_fp8x2_f32<{str(dst == 'e5m2x2').lower()}, {relu}>({d}, {a[0]}, {a[1]})"
        )
    a = stmt.u32(args[1], "cvt source")
    if dst == "f16x2":
        return f"{_PTX_NS}cvt_f16x2_fp8x2<{str(src == 'e5m2x2').lower()}, {relu}>({d}, {a})"
    return f"{_PTX_NS}cvt_fp8x2_f16x2<{str(dst == 'e5m2x2').lower()}, {relu}>({d}, {a})"


def _no_operands(call: str) -> Any:
    def emit(stmt: _AsmStatement, m: re.Match[str], instr: str, args: list[tuple]) -> str:
        _expect(stmt, instr, args, "")
        return f"{_PTX_NS}{call}()"

    return emit


def _ptx_wgmma_wait(stmt: _AsmStatement, m: re.Match[str], instr: str, args: list[tuple]) -> str:
    _expect(stmt, instr, args, "val")
    return f"{_PTX_NS}wgmma_wait_group({stmt.immediate(args[0], 'wgmma.wait_group count')})"


def _ptx_mbarrier_init(stmt: _AsmStatement, m: re.Match[str], instr: str, args: list[tuple]) -> str:
    _expect(stmt, instr, args, "addr val")
    addr = stmt.shared_addr(args[0], "mbarrier address")
    return f"{_PTX_NS}mbarrier_init({addr}, {stmt.u32(args[1], 'mbarrier.init count')})"


def _ptx_mbarrier_inval(
    stmt: _AsmStatement, m: re.Match[str], instr: str, args: list[tuple]
) -> str:
    _expect(stmt, instr, args, "addr")
    return f"{_PTX_NS}mbarrier_inval({stmt.shared_addr(args[0], 'mbarrier address')})"


def _ptx_mbarrier_arrive(
    stmt: _AsmStatement, m: re.Match[str], instr: str, args: list[tuple]
) -> str:
    expect_tx = m.group(1) is not None
    counted = len(args) == 3
    if len(args) not in ((3,) if expect_tx else (2, 3)) or args[1][0] != "addr":
        want = "state addr tx" if expect_tx else "state addr [count]"
        raise _shape_error(stmt, instr, args, want)
    addr = stmt.shared_addr(args[1], "mbarrier address")
    remote = m.group(2) == "::cluster"  # a .shared::cluster address: maybe another block's
    if expect_tx:
        tx = stmt.u32(args[2], "tx-count")
        call = f"{_PTX_NS}mbarrier_arrive_expect_tx({addr}, {tx}, {str(remote).lower()})"
    else:
        count = stmt.u32(args[2], "arrive count") if counted else "1"
        call = f"{_PTX_NS}mbarrier_arrive({addr}, {count}, {str(remote).lower()})"
    state = stmt.out64(args[0], "mbarrier state")
    if remote and state is not None:
        raise stmt.error(f"{instr!r}: an arrive on a .shared::cluster mbarrier returns no state: _")
    return call if state is None else f"{_PTX_NS}set_b64({state}, {call})"


def _ptx_cp_async_mbarrier_arrive(
    stmt: _AsmStatement, m: re.Match[str], instr: str, args: list[tuple]
) -> str:
    _expect(stmt, instr, args, "addr")
    addr = stmt.shared_addr(args[0], "mbarrier address")
    return f"{_PTX_NS}cp_async_mbarrier_arrive({addr}, {str(m.group(1) is not None).lower()})"


def _ptx_mbarrier_expect_tx(
    stmt: _AsmStatement, m: re.Match[str], instr: str, args: list[tuple]
) -> str:
    _expect(stmt, instr, args, "addr val")
    addr = stmt.shared_addr(args[0], "mbarrier address")
    return f"{_PTX_NS}mbarrier_expect_tx({addr}, {stmt.u32(args[1], 'tx-count')})"


def _ptx_mbarrier_wait(stmt: _AsmStatement, m: re.Match[str], instr: str, args: list[tuple]) -> str:
    by_parity = m.group(2) is not None
    hint = m.group(1) == "try_wait" and len(args) == 4  # suspendTimeHint: a limit, no effect
    if len(args) != 3 + hint or args[1][0] != "addr":
        raise _shape_error(stmt, instr, args, "pred addr " + ("parity" if by_parity else "state"))
    if hint:
        stmt.u32(args[3], "try_wait suspendTimeHint")
    done = stmt.pred(args[0], "mbarrier wait result", write=True)
    addr = stmt.shared_addr(args[1], "mbarrier address")
    phase = stmt.u32(args[2], "phase parity") if by_parity else stmt.u64(args[2], "state")
    fn = "mbarrier_try_wait" if m.group(1) == "try_wait" else "mbarrier_test_wait"
    return f"({done} = {_PTX_NS}{fn}({addr}, {str(by_parity).lower()}, {phase}))"


def _ptx_bulk_tensor(stmt: _AsmStatement, m: re.Match[str], instr: str, args: list[tuple]) -> str:
    rank, multicast, hint = int(m.group(1)), m.group(2) is not None, m.group(3) is not None
    kinds = [a[0] for a in args]
    if (
        len(args) != 3 + multicast + hint
        or kinds[:3] != ["addr", "tmap", "addr"]
        or len(args[1][2]) != rank
    ):
        want = (
            f"addr [tmap, vec{rank}] addr"
            + (" ctaMask" if multicast else "")
            + (" policy" if hint else "")
        )
        raise _shape_error(stmt, instr, args, want)
    if hint:  # .L2::cache_hint: a 64-bit cache policy, only a hint
        stmt.u64(args[-1], "cache policy")
    dst = stmt.shared_addr(args[0], "TMA destination")
    tmap = stmt.read_global(args[1][1], "tensor map")
    coords = [stmt.u32(c, "TMA coordinate") for c in args[1][2]]
    bar = stmt.shared_addr(args[2], "mbarrier address")
    if multicast:
        mask = stmt.u32(args[3], "ctaMask")
        return (
            f"{_PTX_NS}cp_async_bulk_tensor_multicast<{rank}>({dst}, {tmap}, {bar}, {mask}, "
            f"{', '.join(coords)})"
        )
    return f"{_PTX_NS}cp_async_bulk_tensor<{rank}>({dst}, {tmap}, {bar}, {', '.join(coords)})"


def _ptx_bulk(stmt: _AsmStatement, m: re.Match[str], instr: str, args: list[tuple]) -> str:
    multicast, hint = m.group(1) is not None, m.group(2) is not None
    if hint and len(args) == 5 + multicast:  # .L2::cache_hint: a 64-bit cache policy
        stmt.u64(args[-1], "cache policy")
        args = args[:-1]
    _expect(stmt, instr, args, "addr addr val addr" + (" val" if multicast else ""))
    dst = stmt.shared_addr(args[0], "cp.async.bulk destination")
    src = stmt.read_global(args[1][1], "cp.async.bulk source")
    if args[1][2]:
        src = f"({src} + {args[1][2]})"
    size = stmt.u32(args[2], "cp.async.bulk size")
    bar = stmt.shared_addr(args[3], "mbarrier address")
    if multicast:
        mask = stmt.u32(args[4], "ctaMask")
        return f"{_PTX_NS}cp_async_bulk_multicast({dst}, {src}, {size}, {bar}, {mask})"
    return f"{_PTX_NS}cp_async_bulk({dst}, {src}, {size}, {bar})"


_REDUCTIONS = {"add": 0, "min": 1, "max": 2}  # kg_tma.h: BulkRedOp
_REDUCE_TYPES = {"u32": 2, "s32": 3, "u64": 4, "s64": 5, "f16": 6, "f32": 7, "f64": 8, "bf16": 9}


def _reduction(stmt: _AsmStatement, op: str, instr: str) -> int:
    if op not in _REDUCTIONS:
        raise stmt.error(
            f"unsupported instruction {instr.split(' ')[0]!r}: the emulator models the "
            f"reductions .add, .min and .max, not .{op}"
        )
    return _REDUCTIONS[op]


def _ptx_bulk_tensor_store(
    stmt: _AsmStatement, m: re.Match[str], instr: str, args: list[tuple]
) -> str:
    """cp.async.bulk.tensor.Nd.global.shared::cta.bulk_group and cp.reduce.async.bulk.tensor."""
    reduce = instr.startswith("cp.reduce")
    rank, hint = int(m.group(1)), m.group(3) is not None
    red = _reduction(stmt, m.group(2), instr) if reduce else -1
    kinds = [a[0] for a in args]
    if len(args) != 2 + hint or kinds[:2] != ["tmap", "addr"] or len(args[0][2]) != rank:
        raise _shape_error(
            stmt, instr, args, f"[tmap, vec{rank}] addr" + (" policy" if hint else "")
        )
    if hint:
        stmt.u64(args[-1], "cache policy")
    tmap = stmt.read_global(args[0][1], "tensor map")
    coords = [stmt.u32(c, "TMA coordinate") for c in args[0][2]]
    src = stmt.shared_addr(args[1], "TMA store source")
    return f"{_PTX_NS}cp_async_bulk_tensor_store<{rank}, {red}>({tmap}, {src}, {', '.join(coords)})"


def _ptx_bulk_store(stmt: _AsmStatement, m: re.Match[str], instr: str, args: list[tuple]) -> str:
    """cp.async.bulk.global.shared::cta.bulk_group and cp.reduce.async.bulk (non-tensor)."""
    reduce = instr.startswith("cp.reduce")
    hint = m.group(1) is not None
    red = _reduction(stmt, m.group(2), instr) if reduce else -1
    code = _REDUCE_TYPES[m.group(3)] if reduce else 0
    if hint and len(args) == 4:
        stmt.u64(args[-1], "cache policy")
        args = args[:-1]
    _expect(stmt, instr, args, "addr addr val")
    dst = stmt.read_global(args[0][1], "cp.async.bulk destination")
    if args[0][2]:
        dst = f"({dst} + {args[0][2]})"
    src = stmt.shared_addr(args[1], "cp.async.bulk source")
    size = stmt.u32(args[2], "cp.async.bulk size")
    return f"{_PTX_NS}cp_async_bulk_store<{red}, {code}>({dst}, {src}, {size})"


def _ptx_bulk_wait(stmt: _AsmStatement, m: re.Match[str], instr: str, args: list[tuple]) -> str:
    _expect(stmt, instr, args, "val")
    n = stmt.immediate(args[0], "cp.async.bulk.wait_group count")
    return f"{_PTX_NS}cp_async_bulk_wait_group({n}, {str(m.group(1) is not None).lower()})"


def _ptx_mapa(stmt: _AsmStatement, m: re.Match[str], instr: str, args: list[tuple]) -> str:
    if len(args) != 3:
        raise _shape_error(stmt, instr, args, "d a rank")
    wide = m.group(2) == "u64"
    a = stmt.u64(args[1], "mapa address") if wide else stmt.u32(args[1], "mapa address")
    rank = stmt.u32(args[2], "mapa rank")
    fn = "mapa_shared" if m.group(1) else "mapa_generic"
    value = f"{_PTX_NS}{fn}(static_cast<uint64_t>({a}), {rank})"
    if not wide:
        return f"{_PTX_NS}set_b32({stmt.out32(args[0], 'mapa destination')}, {value})"
    dest = stmt.out64(args[0], "mapa destination")
    if dest is None:
        raise stmt.error('mapa.u64 destination must be a 64-bit ("=l") operand')
    return f"{_PTX_NS}set_b64({dest}, static_cast<uint64_t>({value}))"


def _ldst_value(stmt: _AsmStatement, arg: tuple, wide: bool, write: bool, role: str) -> str:
    """A 32- or 64-bit ld destination / st source: a "r"/"f" ("l"/"d") operand, a local .b32
    register, or (st) an immediate; moved as bits."""
    if arg[0] == "reg":
        op = stmt.operand(arg[1], "ld" if wide else "rf" + ("" if write else "nih"), write, role)
        return f"({op.expr})" if write else f"{_PTX_NS}b{64 if wide else 32}({op.expr})"
    if not wide:
        return stmt.out32(arg, role) if write else stmt.u32(arg, role)
    if arg[0] == "imm" and not write:
        return f"{arg[1]}ull"
    raise stmt.error(f'{role} must be a 64-bit ("l" or "d") operand')


def _ptx_ld_st(stmt: _AsmStatement, m: re.Match[str], instr: str, args: list[tuple]) -> str:
    """ld / st .shared{::cta,::cluster}{.v2,.v4} of 32- or 64-bit elements."""
    load, cluster = m.group(1) == "ld", m.group(2) == "::cluster"
    n = int(m.group(3)[2]) if m.group(3) else 1  # ".v2" / ".v4"
    wide = m.group(4).endswith("64")
    value_kind = f"vec{n}" if n > 1 else "val"
    shape = f"{value_kind} addr" if load else f"addr {value_kind}"
    if len(args) != 2:
        raise _shape_error(stmt, instr, args, shape)
    addr_arg, value_arg = (args[1], args[0]) if load else (args[0], args[1])
    if addr_arg[0] != "addr" or (n > 1) != (value_arg[0] == "vec"):
        raise _shape_error(stmt, instr, args, shape)
    addr = stmt.shared_addr(addr_arg, "shared address")
    refs = [("reg", r) for r in value_arg[1]] if n > 1 else [value_arg]
    role = "ld destination" if load else "st value"
    values = [_ldst_value(stmt, r, wide, load, role) for r in refs]
    fn = "ld_shared_v" if load else "st_shared_v"
    ctype = "uint64_t" if wide else "uint32_t"
    what = instr.split(" ")[0]
    return f'{_PTX_NS}{fn}<{ctype}>({addr}, {str(cluster).lower()}, "{what}", {", ".join(values)})'


def _ptx_elect(stmt: _AsmStatement, m: re.Match[str], instr: str, args: list[tuple]) -> str:
    if len(args) != 2 or args[0][0] != "pair":
        raise _shape_error(stmt, instr, args, "R|P membermask")
    elected = stmt.out32(args[0][1], "elect.sync lane")
    is_elected = stmt.pred(args[0][2], "elect.sync predicate", write=True)
    mask = stmt.u32(args[1], "elect.sync membermask")
    return f"{_PTX_NS}elect_sync({mask}, {elected}, {is_elected})"


def _ptx_setmaxnreg(stmt: _AsmStatement, m: re.Match[str], instr: str, args: list[tuple]) -> str:
    _expect(stmt, instr, args, "val")
    if args[0][0] == "imm" and (args[0][1] % 8 or not 24 <= args[0][1] <= 256):
        raise stmt.error(f"{instr!r}: the register count must be a multiple of 8 in [24, 256]")
    return f"{_PTX_NS}setmaxnreg<{stmt.immediate(args[0], 'setmaxnreg count')}>()"


def _ptx_prefetch_tensormap(
    stmt: _AsmStatement, m: re.Match[str], instr: str, args: list[tuple]
) -> str:
    _expect(stmt, instr, args, "addr")
    return f"{_PTX_NS}prefetch_tensormap({stmt.read_global(args[0][1], 'tensor map')})"


def _ptx_cvta(stmt: _AsmStatement, m: re.Match[str], instr: str, args: list[tuple]) -> str:
    if len(args) != 2 or args[1][0] != "reg":
        raise _shape_error(stmt, instr, args, "d a")
    addr = f"{_PTX_NS}shared_address_of({stmt.read_global(args[1][1], 'cvta source')})"
    if m.group(1) == "u32":
        return f"{_PTX_NS}set_b32({stmt.out32(args[0], 'cvta destination')}, {addr})"
    dest = stmt.out64(args[0], "cvta destination")
    if dest is None:
        raise stmt.error('cvta destination must be a 64-bit ("=l") operand')
    return f"{_PTX_NS}set_b64({dest}, static_cast<uint64_t>({addr}))"


def _ptx_nanosleep(stmt: _AsmStatement, m: re.Match[str], instr: str, args: list[tuple]) -> str:
    _expect(stmt, instr, args, "val")
    return f"{_PTX_NS}nanosleep({stmt.u32(args[0], 'nanosleep time')})"


def _ptx_prefetch(stmt: _AsmStatement, m: re.Match[str], instr: str, args: list[tuple]) -> str:
    _expect(stmt, instr, args, "addr")
    return f"(void){stmt.read_global(args[0][1], 'prefetch address')}"


def _ptx_setp(stmt: _AsmStatement, m: re.Match[str], instr: str, args: list[tuple]) -> str:
    if len(args) != 3:
        raise _shape_error(stmt, instr, args, "pred a b")
    p = stmt.pred(args[0], "setp destination", write=True)
    a, b = stmt.u32(args[1], "setp operand"), stmt.u32(args[2], "setp operand")
    cast = "int32_t" if m.group(2) == "s32" else "uint32_t"
    op = "==" if m.group(1) == "eq" else "!="
    return f"({p} = static_cast<{cast}>({a}) {op} static_cast<{cast}>({b}))"


def _ptx_selp(stmt: _AsmStatement, m: re.Match[str], instr: str, args: list[tuple]) -> str:
    if len(args) != 4:
        raise _shape_error(stmt, instr, args, "d a b pred")
    d = stmt.out32(args[0], "selp destination")
    a, b = stmt.u32(args[1], "selp operand"), stmt.u32(args[2], "selp operand")
    p = stmt.pred(args[3], "selp predicate")
    return f"{_PTX_NS}set_b32({d}, {p} ? static_cast<uint32_t>({a}) : static_cast<uint32_t>({b}))"


def _ptx_mov(stmt: _AsmStatement, m: re.Match[str], instr: str, args: list[tuple]) -> str:
    if len(args) != 2:
        raise _shape_error(stmt, instr, args, "d a")
    d = stmt.out32(args[0], "mov destination")
    return f"{_PTX_NS}set_b32({d}, static_cast<uint32_t>({stmt.u32(args[1], 'mov source')}))"


def _ptx_bar(stmt: _AsmStatement, m: re.Match[str], instr: str, args: list[tuple]) -> str:
    arrive = m.group(1) == "arrive"
    if len(args) not in ((2,) if arrive else (1, 2)) or any(
        a[0] not in ("reg", "imm", "local") for a in args
    ):
        raise _shape_error(stmt, instr, args, "a, b" if arrive else "a{, b}")
    values = [
        stmt.u32(a, "barrier id" if i == 0 else "barrier thread count") for i, a in enumerate(args)
    ]
    return f"{_PTX_NS}bar_{'arrive' if arrive else 'sync'}({', '.join(values)})"


_SHARED = r"\.shared(?:::cta)?"
_MBAR_SCOPE = r"(?:\.cta|\.cluster)?"
HOPPER_FORMS: tuple[tuple[str, Any], ...] = (
    (
        r"wgmma\.mma_async\.sync\.aligned\.m64n(\d+)k(16|32)\.(f32|f16)"
        r"\.(f16|bf16|e4m3|e5m2)\.(f16|bf16|e4m3|e5m2)",
        _ptx_wgmma,
    ),
    (
        r"cvt\.rn\.satfinite(?P<relu>\.relu)?\.(?P<dst>e4m3x2|e5m2x2)\.(?P<src>f32|f16x2)",
        _ptx_cvt_fp8,
    ),
    (r"cvt\.rn(?P<relu>\.relu)?\.(?P<dst>f16x2)\.(?P<src>e4m3x2|e5m2x2)", _ptx_cvt_fp8),
    (
        r"cvt\.rn(?P<relu>\.relu)?(?P<sat>\.satfinite)?\.(?P<dst>f16x2|bf16x2)\.(?P<src>f32)",
        _ptx_cvt_fp8,
    ),
    (r"wgmma\.fence\.sync\.aligned", _no_operands("wgmma_fence")),
    (r"wgmma\.commit_group\.sync\.aligned", _no_operands("wgmma_commit_group")),
    (r"wgmma\.wait_group\.sync\.aligned", _ptx_wgmma_wait),
    (rf"mbarrier\.init{_SHARED}\.b64", _ptx_mbarrier_init),
    (rf"mbarrier\.inval{_SHARED}\.b64", _ptx_mbarrier_inval),
    (
        rf"mbarrier\.arrive(\.expect_tx)?(?:\.release)?{_MBAR_SCOPE}\.shared(::cta|::cluster)?"
        r"\.b64",
        _ptx_mbarrier_arrive,
    ),
    (rf"cp\.async\.mbarrier\.arrive(\.noinc)?{_SHARED}\.b64", _ptx_cp_async_mbarrier_arrive),
    (rf"mbarrier\.expect_tx(?:\.relaxed)?{_MBAR_SCOPE}{_SHARED}\.b64", _ptx_mbarrier_expect_tx),
    (
        rf"mbarrier\.(try_wait|test_wait)(\.parity)?(?:\.acquire)?{_MBAR_SCOPE}{_SHARED}\.b64",
        _ptx_mbarrier_wait,
    ),
    (
        r"cp\.async\.bulk\.tensor\.([1-5])d\.shared::(?:cluster|cta)\.global(?:\.tile)?"
        r"\.mbarrier::complete_tx::bytes(\.multicast::cluster)?(\.L2::cache_hint)?",
        _ptx_bulk_tensor,
    ),
    (
        r"cp\.async\.bulk\.shared::(?:cluster|cta)\.global\.mbarrier::complete_tx::bytes"
        r"(\.multicast::cluster)?(\.L2::cache_hint)?",
        _ptx_bulk,
    ),
    (
        r"cp\.async\.bulk\.tensor\.([1-5])d\.global\.shared::cta(?:\.tile)?\.bulk_group()"
        r"(\.L2::cache_hint)?",
        _ptx_bulk_tensor_store,
    ),
    (
        r"cp\.reduce\.async\.bulk\.tensor\.([1-5])d\.global\.shared::cta\.(\w+)(?:\.tile)?"
        r"\.bulk_group(\.L2::cache_hint)?",
        _ptx_bulk_tensor_store,
    ),
    (r"cp\.async\.bulk\.global\.shared::cta\.bulk_group(\.L2::cache_hint)?()()", _ptx_bulk_store),
    (
        r"cp\.reduce\.async\.bulk\.global\.shared::cta\.bulk_group(\.L2::cache_hint)?\.(\w+)"
        r"(?:\.noftz)?\.(u32|s32|u64|s64|f16|f32|f64|bf16)",
        _ptx_bulk_store,
    ),
    (r"cp\.async\.bulk\.commit_group", _no_operands("cp_async_bulk_commit_group")),
    (r"cp\.async\.bulk\.wait_group(\.read)?", _ptx_bulk_wait),
    (
        r"stmatrix((?:\.[A-Za-z0-9_:]+)+)",
        _ptx_stmatrix,
    ),
    (
        r"barrier\.cluster\.arrive(?:\.release|\.relaxed)?(?:\.aligned)?",
        _no_operands("barrier_cluster_arrive"),
    ),
    (r"barrier\.cluster\.wait(?:\.acquire)?(?:\.aligned)?", _no_operands("barrier_cluster_wait")),
    (r"mapa(\.shared::cluster)?\.(u32|u64)", _ptx_mapa),
    (
        r"(ld|st)(?:\.volatile|\.weak)?\.shared(::cta|::cluster)?(\.v[24])?"
        r"\.(b32|u32|s32|f32|b64|u64|s64|f64)",
        _ptx_ld_st,
    ),
    (
        r"fence\.(?:sc|acq_rel|acquire|release)\.(?:cta|cluster|gpu|sys)",
        _no_operands("fence_proxy_async"),
    ),
    (r"cvta\.to\.shared(?:::cta)?\.(u32|u64)", _ptx_cvta),
    (r"nanosleep\.u32", _ptx_nanosleep),
    (
        r"prefetch(?:\.global|\.local)?\.(?:L1|L2)(?:::evict_(?:last|normal))?|prefetchu\.L1",
        _ptx_prefetch,
    ),
    (r"griddepcontrol\.(?:wait|launch_dependents)", _no_operands("compiler_barrier")),
    (
        r"fence\.proxy\.async(?:\.shared::(?:cta|cluster))?",
        _no_operands("fence_proxy_async_shared"),
    ),
    (r"fence\.proxy\.async\.global", _no_operands("fence_proxy_async")),
    (r"fence\.mbarrier_init\.release\.cluster", _no_operands("fence_proxy_async")),
    (r"elect\.sync", _ptx_elect),
    (r"setmaxnreg\.(?:inc|dec)\.sync\.aligned\.u32", _ptx_setmaxnreg),
    (r"prefetch\.tensormap", _ptx_prefetch_tensormap),
    (r"(?:bar(?:\.cta)?|barrier(?:\.cta)?)\.(sync|arrive)(?:\.aligned)?", _ptx_bar),
    (r"setp\.(eq|ne)\.(b32|u32|s32)", _ptx_setp),
    (r"selp\.(?:b32|u32|s32)", _ptx_selp),
    (r"mov\.(?:b32|u32|s32)", _ptx_mov),
)
# The supported instruction forms (opcode with its modifiers -> emitter). Anything else is an
# error at transform time, never silently dropped.
PTX_FORMS: tuple[tuple[str, Any], ...] = (
    (r"ldmatrix((?:\.[A-Za-z0-9_:]+)+)", _ptx_ldmatrix),
    (r"mma\.sync\.aligned\.m16n8k16\.row\.col\.f32\.(f16|bf16)\.(f16|bf16)\.f32", _ptx_mma),
    (rf"cp\.async\.(ca|cg){_SHARED}\.global(?:\.L2::(?:64|128|256)B)?", _ptx_cp_async),
    (r"cp\.async\.commit_group", _ptx_commit),
    (r"cp\.async\.wait_group", _ptx_wait_group),
    (r"cp\.async\.wait_all", _ptx_wait_all),
    *HOPPER_FORMS,
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
        "mma.sync .m16n8k16 (f16/bf16 -> f32), cp.async and the Hopper forms of "
        "docs/emulator.md (wgmma, mbarrier, TMA loads and stores, stmatrix, named barriers, "
        "clusters)"
    )


def _control_flow(stmt: _AsmStatement, instr: str) -> str | None:
    """A label (``:NAME`` from :func:`_ptx_instructions`) or a ``bra`` as C++ (a label and a
    ``goto`` in the lambda of the block), else None."""
    if instr.startswith(":"):
        return f"{_local_name('L_' + instr[1:])}:"
    if m := _BRA_RE.fullmatch(instr):
        if m.group(1) not in stmt.labels:
            raise stmt.error(f"bra to {m.group(1)}, which is not a label of the asm block")
        return f"goto {_local_name('L_' + m.group(1))}"
    if instr.split(" ")[0].startswith("bra"):
        raise stmt.error(
            f"unsupported branch {instr!r}: only `bra{{.uni}} LABEL` to a label of "
            "the same asm block"
        )
    return None


def _asm_replacement(stmt: _AsmStatement) -> str:
    instructions = _ptx_instructions(stmt)
    calls = [
        (guard, _control_flow(stmt, instr) or _ptx_call(stmt, instr))
        for guard, instr in instructions
    ]
    if stmt.labels:  # labels end a block; a label before `}` labels an empty statement
        calls.append(("", ";"))
    if not calls:  # asm volatile("" ::: "memory")
        return f"{_PTX_NS}compiler_barrier()"
    if not stmt.locals and not stmt.labels:
        plain = [call for _, call in calls]
        return plain[0] if len(plain) == 1 else f"({', '.join(plain)})"
    # A PTX block: its registers become locals of a lambda run in place.
    decls = [
        f"{'bool' if kind == 'pred' else 'uint32_t'} {_local_name(name)} = 0;"
        for name, kind in stmt.locals.items()
    ]
    decls.append(f"uint32_t {_SINK32} = 0; (void){_SINK32};")
    body = [
        (f"if ({'!' if g.startswith('!') else ''}{_local_name(g.lstrip('!'))}) " if g else "")
        + (call if call.endswith((":", ";")) else f"{call};")
        for g, call in calls
    ]
    return "[&]() { " + " ".join(decls + body) + " }()"


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
