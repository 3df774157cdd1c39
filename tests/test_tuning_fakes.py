"""Fakes shared by the tuning tests (no tests here): a device, software, compile and bench."""

from __future__ import annotations

import zlib
from collections.abc import Callable

from kernelgen.errors import CompileError
from kernelgen.kernels.compile import Resources
from kernelgen.specs.forward import KernelSpec
from kernelgen.tuning import (
    DeviceInfo,
    MeasureSettings,
    ProblemDesc,
    SoftwareInfo,
    TunedLaunch,
    TuningKey,
    TuningRecord,
    tune_problem,
)

DEVICE = DeviceInfo("Fake GPU 80GB", "9.0", 132)
SOFTWARE = SoftwareInfo("0.1.0", "ab" * 32, "13.0", "13.0", "14.0.0")
FAST = MeasureSettings(budget_ms=1.0, retime_top=3, retime_budget_ms=1.0, screen_budget_ms=0.5)


def problem(**overrides: object) -> ProblemDesc:
    fields: dict[str, object] = {
        "dtype": "bfloat16",
        "batch": 2,
        "num_heads": 16,
        "num_kv_heads": 16,
        "seqlen_q": 1024,
        "seqlen_k": 1024,
        "head_dim": 128,
    }
    fields.update(overrides)
    return ProblemDesc(**fields)  # type: ignore[arg-type]


def fake_compile(
    spills: frozenset[str] = frozenset(), broken: frozenset[str] = frozenset()
) -> Callable[[KernelSpec, str], Resources]:
    """ptxas as a table: spills for URIs in ``spills``, a compile error for ``broken``."""

    def compile_fn(spec: KernelSpec, arch: str) -> Resources:
        if spec.uri in broken:
            raise CompileError(spec.uri, "error: fake compile failure", None)
        spill = 64 if spec.uri in spills else 0
        return Resources(arch, 128, spill, spill, 0, 0)

    return compile_fn


def stable_ms(spec: KernelSpec, num_splits: int | None = None) -> float:
    """A made-up but deterministic time per launch."""
    label = TunedLaunch(spec, num_splits).label
    return 1.0 + (zlib.crc32(label.encode()) % 1000) / 1000


class FakeBench:
    """Times from a function of the launch; failing specs by URI, wrong outputs by label."""

    def __init__(
        self,
        timing: Callable[[KernelSpec, int | None], float] = stable_ms,
        fail: frozenset[str] = frozenset(),
        wrong: frozenset[str] = frozenset(),
    ) -> None:
        self.timing, self.fail, self.wrong = timing, fail, wrong
        self.compiled: list[str] = []
        self.timed: list[str] = []
        self.min_reps: list[int] = []  # what each time() call was asked for
        self.checked: list[str] = []

    def compile(self, spec: KernelSpec) -> None:
        self.compiled.append(spec.uri)
        if spec.uri in self.fail:
            raise CompileError(spec.uri, "launch failed", None)

    def time(
        self,
        spec: KernelSpec,
        budget_ms: float,
        num_splits: int | None = None,
        *,
        min_reps: int,
    ) -> list[float]:
        self.timed.append(TunedLaunch(spec, num_splits).label)
        self.min_reps.append(min_reps)
        base = self.timing(spec, num_splits)
        return [base * f for f in (1.02, 0.99, 1.0, 1.01, 1.0)]

    def check(self, spec: KernelSpec, num_splits: int | None = None) -> str | None:
        label = TunedLaunch(spec, num_splits).label
        self.checked.append(label)
        return "relative error 1e+00 > 1e-02" if label in self.wrong else None


def fake_tuner(bench: FakeBench | None = None) -> Callable[[ProblemDesc, TuningKey], TuningRecord]:
    def tuner(p: ProblemDesc, key: TuningKey) -> TuningRecord:
        return tune_problem(p, key, bench or FakeBench(), compile_fn=fake_compile(), settings=FAST)

    return tuner
