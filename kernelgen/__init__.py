"""kernelgen: readable, specialized FlashAttention kernels from declarative tiling specs.

spec (YAML, Pydantic) -> render (Jinja2) -> compile (NVRTC) -> launch (CuPy) -> policy (default
specs) -> tune -> attention().
"""

from kernelgen.api import attention
from kernelgen.errors import (
    CompileError,
    InputError,
    InputTypeError,
    KernelgenError,
    SettingError,
    SpecError,
    ToolchainMissingError,
)
from kernelgen.kvcache import attention_with_kvcache
from kernelgen.policy import default_spec
from kernelgen.render import render
from kernelgen.spec import KernelSpec, load_spec
from kernelgen.tuning import TuningMissError, autotune, warmup
from kernelgen.varlen import attention_varlen
from kernelgen.version import __version__

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
    "attention_varlen",
    "attention_with_kvcache",
    "autotune",
    "default_spec",
    "load_spec",
    "render",
    "warmup",
]
