"""kernelgen's typed errors: each names the field or argument, the value and what is allowed."""

from __future__ import annotations

import sys


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


class UnsafeFolderError(KernelgenError, PermissionError):
    """A folder kernelgen would load code from or write into is not private to the user (another
    user owns it, or others may write to it); names the folder and why (docs/security.md)."""

    def __init__(self, folder: object, reason: str) -> None:
        self.folder = str(folder)
        self.reason = reason
        super().__init__(
            f"refusing to use {self.folder}: {reason}; kernelgen keeps builds and sources only "
            "in a folder of the user's own that no one else can write to"
        )


class EmulatorError(KernelgenError):
    """Base class of the CPU emulator's errors (:mod:`kernelgen.emulator`)."""


class EmulatorUnavailableError(EmulatorError, ToolchainMissingError):
    """The C++ compiler the emulator builds kernels with (g++) is not installed."""


class EmulatorSourceError(EmulatorError, ValueError):
    """The CUDA source uses something the emulator does not model (an inline-PTX instruction
    outside its table, a shared-memory declaration it cannot parse); names it and the line."""


class EmulatorCompileError(EmulatorError, RuntimeError):
    """g++ rejected the emulator's C++ translation of a kernel; carries the compiler output and
    where the translated source was saved."""

    def __init__(self, name: str, log: str, source_path: str | None) -> None:
        self.name = name
        self.log = log
        self.source_path = source_path
        where = f" (source: {source_path})" if source_path else ""
        super().__init__(
            f"g++ failed to compile kernel {name!r} for the CPU emulator{where}:\n{log}"
        )


class EmulatorSettingError(EmulatorError, SettingError):
    """An environment variable the emulator reads at launch (e.g. KG_EMULATOR_BLOCK_ORDER) holds
    a value it cannot use; names the variable, the value and what is allowed."""


class EmulatorArgumentError(EmulatorError, ValueError):
    """A launch argument or configuration has a bad value (grid, block, shared memory, range)."""


class EmulatorArgumentTypeError(EmulatorError, TypeError):
    """A launch argument has the wrong type or dtype for the kernel parameter."""


class EmulatorLaunchError(EmulatorError, RuntimeError):
    """The emulated kernel failed while running: ``__trap()``, a bad shared-memory address, a
    write outside the dynamic shared memory, a deadlock. Names the block and thread."""

    def __init__(self, kernel: str, message: str) -> None:
        self.kernel = kernel
        self.message = message
        super().__init__(f"emulated launch of {kernel}: {message}")


class HazardError(EmulatorLaunchError):
    """The race check found a shared-memory hazard between cp.async writes and ldmatrix reads
    (a missing ``cp.async.wait_group`` or ``__syncthreads``)."""


class EmulatorTimeoutError(EmulatorLaunchError):
    """A block did not finish within the watchdog's time (a deadlock or an endless loop)."""


class CaptureError(InputError):
    """An argument that needs a host upload or a temporary outside the caller's library, given
    while the call's stream is capturing a CUDA graph (the graph would keep a freed address or a
    host value fixed at capture)."""


class KernelgenWarning(UserWarning):
    """Base class of kernelgen's warnings."""


class CPUBackendWarning(KernelgenWarning):
    """attention() got host arrays and runs its kernels in the CPU emulator: correct, slow
    (issued once per process)."""


_INNER_PACKAGES = ("kernelgen", "torch")  # frames a warning skips to reach the caller's


def caller_stacklevel() -> int:
    """``warnings.warn``'s stacklevel, for the function that calls it, naming the first frame
    outside kernelgen and torch (the user's call, however deep the call chain: the public
    wrappers, torch autograd's Function.apply)."""
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_globals.get("__name__", "").split(".")[0] in (
        _INNER_PACKAGES
    ):
        frame, level = frame.f_back, level + 1
    return level if frame is not None else 1
