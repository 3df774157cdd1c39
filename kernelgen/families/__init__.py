"""Kernel families: what a kernel computes (docs/design.md, "Families and engines").

The forward family (attention's output and lse) is :mod:`kernelgen.specs.forward`,
:mod:`kernelgen.kernels.render` and :mod:`kernelgen.runtime.launch`; the backward family (dQ, dK,
dV) is :mod:`kernelgen.specs.backward` and :mod:`.backward`. A spec file names its family with
``family:`` (absent: forward); this module loads and renders any of them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import ValidationError

from kernelgen.errors import SpecError
from kernelgen.families import backward
from kernelgen.kernels.render import render as render_forward
from kernelgen.specs.backward import BackwardSpec
from kernelgen.specs.forward import (
    KernelSpec,
    format_validation_error,
    load_spec_data,
    spec_from_dict,
)

AnySpec = KernelSpec | BackwardSpec
FAMILIES = ("forward", "backward")

__all__ = ["FAMILIES", "AnySpec", "family_of", "load_any_spec", "render_any", "spec_of_family"]


def family_of(spec: AnySpec) -> str:
    """The family of a loaded spec."""
    return "backward" if isinstance(spec, BackwardSpec) else "forward"


def spec_of_family(data: Any, source: str | None = None) -> AnySpec:
    """Validate a mapping into the spec of the family it names (``family``, default forward),
    raising :class:`SpecError` with one line per problem."""
    family = data.get("family", "forward") if isinstance(data, dict) else "forward"
    if family == "forward":
        if isinstance(data, dict):
            data = {k: v for k, v in data.items() if k != "family"}
        return spec_from_dict(data, source)
    if family != "backward":
        raise SpecError(
            [f"family={family!r:.80} is not allowed; use one of {', '.join(FAMILIES)}"], source
        )
    try:
        return BackwardSpec.model_validate(data)
    except ValidationError as exc:
        problems = format_validation_error(exc, BackwardSpec.model_fields)
        raise SpecError(problems, source) from None


def load_any_spec(path: str | Path) -> AnySpec:
    """Read one spec file of any family (the same safe, bounded YAML reading as load_spec)."""
    return spec_of_family(load_spec_data(path), str(path))


def render_any(spec: AnySpec) -> str:
    """CUDA source of a spec of any family."""
    if isinstance(spec, BackwardSpec):
        return backward.render(spec)
    return render_forward(spec)
