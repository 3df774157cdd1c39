"""Autotuning: candidate specs per problem, static pruning, GPU timing, a persistent database.

See docs/autotuning.md. Nothing here imports CuPy until a GPU is actually used.
"""

from __future__ import annotations

from kernelgen.tuning.autotune import (
    TuningFailedError,
    TuningMissError,
    autotune,
    autotune_mode,
    clear_memo,
    gpu_tuner,
    heuristic_spec,
    make_key,
    select_launch,
    select_spec,
    tune_problem,
    warmup,
)
from kernelgen.tuning.candidates import (
    Candidate,
    Dropped,
    TunedLaunch,
    offline_resources,
    prune,
)
from kernelgen.tuning.db import TuningDB, TuningRecord, cache_dir
from kernelgen.tuning.key import DeviceInfo, ProblemDesc, SoftwareInfo, TuningKey
from kernelgen.tuning.measure import Bench, Measurement, MeasureSettings

__all__ = [
    "Bench",
    "Candidate",
    "DeviceInfo",
    "Dropped",
    "MeasureSettings",
    "Measurement",
    "ProblemDesc",
    "SoftwareInfo",
    "TunedLaunch",
    "TuningDB",
    "TuningFailedError",
    "TuningKey",
    "TuningMissError",
    "TuningRecord",
    "autotune",
    "autotune_mode",
    "cache_dir",
    "clear_memo",
    "gpu_tuner",
    "heuristic_spec",
    "make_key",
    "offline_resources",
    "prune",
    "select_launch",
    "select_spec",
    "tune_problem",
    "warmup",
]
