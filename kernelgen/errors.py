"""kernelgen's typed errors: each names the field or argument, the value and what is allowed."""

from __future__ import annotations


class KernelgenError(Exception):
    """Base class of every error kernelgen raises on purpose."""


class SpecError(KernelgenError, ValueError):
    """A spec file or spec value is invalid; ``problems`` holds one line per problem."""

    def __init__(self, problems: list[str], source: str | None = None) -> None:
        self.problems = list(problems)
        self.source = source
        prefix = f"{source}: " if source else ""
        super().__init__("\n".join(prefix + p for p in self.problems))


class InputError(KernelgenError, ValueError):
    """An argument of ``attention()`` has a bad value (shape, size, layout, spec mismatch)."""


class InputTypeError(KernelgenError, TypeError):
    """An argument of ``attention()`` has a bad type (dtype, host array, unknown object)."""


class CompileError(KernelgenError, RuntimeError):
    """NVRTC rejected a generated source; carries the log and where the source was saved."""

    def __init__(self, name: str, log: str, source_path: str | None) -> None:
        self.name = name
        self.log = log
        self.source_path = source_path
        where = f" (source saved to {source_path})" if source_path else ""
        super().__init__(f"NVRTC failed to compile {name}{where}:\n{log}")


class ToolchainMissingError(KernelgenError, RuntimeError):
    """A CUDA component (NVRTC, headers, CuPy, a GPU) needed for this operation is missing."""


class SettingError(KernelgenError, ValueError):
    """An environment variable kernelgen reads (e.g. KERNELGEN_TEMPLATE_DIR) holds a value it
    cannot use."""


class CaptureError(InputError):
    """An argument that needs a host upload or a temporary outside the caller's library, given
    while the call's stream is capturing a CUDA graph (the graph would keep a freed address or a
    host value fixed at capture)."""
