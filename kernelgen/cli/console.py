"""The consoles of the ``kernelgen`` command.

On a terminal, output fits the terminal's width. Piped or logged output is never wrapped: a
kernel name stays on one line and tables stay whole, however wide (rich would assume 80
columns).
"""

from __future__ import annotations

from typing import TextIO

import typer
from rich.console import Console

UNWRAPPED_WIDTH = 10_000  # columns assumed when the stream is not a terminal


class UnwrappedConsole(Console):
    """A rich Console that asks its stream, at each print, whether it is a terminal: if not,
    it lays out as if it were :data:`UNWRAPPED_WIDTH` columns wide (tables only take the width
    they need)."""

    @property
    def width(self) -> int:  # type: ignore[override]
        if not _is_terminal(self.file):
            return UNWRAPPED_WIDTH
        return super().width

    @width.setter
    def width(self, value: int) -> None:
        self._width = value

    @property
    def size(self):  # type: ignore[no-untyped-def,override]
        size = super().size
        if not _is_terminal(self.file):
            return size._replace(width=UNWRAPPED_WIDTH)  # ConsoleDimensions is a NamedTuple
        return size

    @size.setter
    def size(self, new_size) -> None:  # type: ignore[no-untyped-def]
        width, height = new_size
        self._width, self._height = width, height


def _is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


out_console = UnwrappedConsole()
err_console = UnwrappedConsole(stderr=True, highlight=False, soft_wrap=True)


def fail(lines: list[str], code: int = 2) -> typer.Exit:
    """Print each problem as one line on stderr; the Exit to raise (2: bad input, 1: a check
    failed)."""
    for line in lines:
        err_console.print(line, markup=False)
    return typer.Exit(code)


def plural(count: int, noun: str) -> str:
    """``1 kernel``, ``2 kernels``: a count and its noun, in the plural unless it is 1."""
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"
