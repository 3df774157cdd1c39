"""kernelgen: readable, specialized FlashAttention kernels from declarative tiling specs.

spec (YAML, Pydantic) -> render (Jinja2) -> compile (NVRTC) -> launch (CuPy) -> policy (default
specs) -> tune -> attention().
"""

from kernelgen.backward_api import attention_backward
from kernelgen.block_mask import BlockMask, block_mask
from kernelgen.errors import (
    CompileError,
    InputError,
    InputTypeError,
    KernelgenError,
    SettingError,
    SpecError,
    ToolchainMissingError,
)
from kernelgen.expressions import Expression, ModInput, parse_mask_mod, parse_score_mod
from kernelgen.families.backward_spec import BackwardSpec
from kernelgen.kvcache import attention_with_kvcache
from kernelgen.policy import default_spec
from kernelgen.render import render
from kernelgen.spec import KernelSpec, load_spec
from kernelgen.training import attention
from kernelgen.tuning import TuningMissError, autotune, warmup
from kernelgen.varlen import attention_varlen
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
