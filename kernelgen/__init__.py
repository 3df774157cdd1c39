"""kernelgen: readable, specialized FlashAttention kernels from declarative tiling specs.

spec (YAML, Pydantic) -> render (Jinja2) -> compile (NVRTC) -> launch (CuPy) -> policy (default
specs) -> tune -> attention().
"""

from kernelgen.calls.backward import attention_backward
from kernelgen.calls.block_mask import BlockMask, block_mask
from kernelgen.calls.kvcache import attention_with_kvcache
from kernelgen.calls.training import attention
from kernelgen.calls.varlen import attention_varlen
from kernelgen.errors import (
    CompileError,
    InputError,
    InputTypeError,
    KernelgenError,
    SettingError,
    SpecError,
    ToolchainMissingError,
)
from kernelgen.kernels.render import render
from kernelgen.model.policy import default_spec
from kernelgen.specs.backward import BackwardSpec
from kernelgen.specs.expressions import Expression, ModInput, parse_mask_mod, parse_score_mod
from kernelgen.specs.forward import KernelSpec, load_spec
from kernelgen.tuning import TuningMissError, autotune, warmup
from kernelgen.version import __version__

__all__ = [
    "BackwardSpec",
    "BlockMask",
    "CompileError",
    "Expression",
    "InputError",
    "InputTypeError",
    "KernelSpec",
    "KernelgenError",
    "ModInput",
    "SettingError",
    "SpecError",
    "ToolchainMissingError",
    "TuningMissError",
    "__version__",
    "attention",
    "attention_backward",
    "attention_varlen",
    "attention_with_kvcache",
    "autotune",
    "block_mask",
    "default_spec",
    "load_spec",
    "parse_mask_mod",
    "parse_score_mod",
    "render",
    "warmup",
]
