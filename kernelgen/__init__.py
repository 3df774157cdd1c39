"""kernelgen: readable, specialized FlashAttention kernels from declarative tiling specs.

spec (YAML, Pydantic) -> render (Jinja2) -> compile (NVRTC) -> launch (CuPy) -> attention().
"""

__version__ = "0.1.0"

from kernelgen.api import attention, default_spec
from kernelgen.errors import (
    CompileError,
    InputError,
    InputTypeError,
    KernelgenError,
    SettingError,
    SpecError,
    ToolchainMissingError,
)
from kernelgen.render import render
from kernelgen.spec import KernelSpec, load_spec
from kernelgen.tuning import TuningMissError, autotune, warmup

__all__ = [
    "CompileError",
    "InputError",
    "InputTypeError",
    "KernelSpec",
    "KernelgenError",
    "SettingError",
    "SpecError",
    "ToolchainMissingError",
    "TuningMissError",
    "__version__",
    "attention",
    "autotune",
    "default_spec",
    "load_spec",
    "render",
    "warmup",
]
