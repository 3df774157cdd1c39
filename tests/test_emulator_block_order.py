"""The emulator's block order (``block_order=`` / ``KG_EMULATOR_BLOCK_ORDER``): blocks run in a
seeded permutation, so tests can show whether a kernel's atomics make results depend on it."""

from __future__ import annotations

import numpy as np
import pytest

from kernelgen.emulator import (
    EmulatedKernel,
    EmulatorArgumentError,
    EmulatorArgumentTypeError,
    EmulatorLaunchError,
    EmulatorSettingError,
    build_kernel,
)
from kernelgen.emulator.kernel import MAX_SHUFFLED_BLOCKS
from kernelgen.errors import SettingError

pytestmark = pytest.mark.emulate

ENV = "KG_EMULATOR_BLOCK_ORDER"
_MASK64 = (1 << 64) - 1


def _shuffled(nblocks: int, seed: int) -> list[int]:
    """kg_emulator.h's shuffled_blocks in Python: Fisher-Yates over the linear block indices,
    drawing from splitmix64 seeded with ``seed``."""
    order = list(range(nblocks))
    state = seed
    for i in range(nblocks, 1, -1):
        state = (state + 0x9E3779B97F4A7C15) & _MASK64
        z = state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
        z ^= z >> 31
        j = (z * i) >> 64
        order[i - 1], order[j] = order[j], order[i - 1]
    return order


# Thread 0 of every block appends the block's linear index to `out` (the order blocks ran in);
# the block `trap_block` traps after that.
RECORD_SRC = r"""
extern "C" __global__ void record_order(int* counter, int* out, int trap_block) {
  const int b = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
  if (threadIdx.x == 0) out[atomicAdd(counter, 1)] = b;
  __syncthreads();
  if (b == trap_block && threadIdx.x == 5) __trap();
}
"""

# Thread 0 of block b adds x[b] into one float: the result is the float32 sum in block order.
SUM_SRC = r"""
extern "C" __global__ void atomic_sum(const float* x, float* total) {
  if (threadIdx.x == 0) atomicAdd(total, x[blockIdx.x]);
}
"""


@pytest.fixture(scope="module")
def record_kernel() -> EmulatedKernel:
    return build_kernel(
        RECORD_SRC, "record_order", [("int*", "counter"), ("int*", "out"), ("int", "trap_block")]
    )


@pytest.fixture(scope="module")
def sum_kernel() -> EmulatedKernel:
    return build_kernel(SUM_SRC, "atomic_sum", [("const float*", "x"), ("float*", "total")])


@pytest.fixture(autouse=True)
def _no_env_order(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV, raising=False)


def _order(
    kern: EmulatedKernel, grid: tuple[int, ...], block_order: int | None = None
) -> list[int]:
    n = int(np.prod(grid))
    counter = np.zeros(1, np.int32)
    out = np.full(n, -1, np.int32)
    kern(grid=grid, block=32, args=[counter, out, -1], block_order=block_order)
    assert counter[0] == n
    return out.tolist()


@pytest.mark.parametrize("grid", [(7,), (5, 3), (3, 2, 4)], ids=["1d", "2d", "3d"])
def test_block_order_is_a_seeded_permutation(record_kernel: EmulatedKernel, grid) -> None:
    n = int(np.prod(grid))
    identity = list(range(n))
    assert _order(record_kernel, grid) == identity
    assert _order(record_kernel, grid, block_order=0) == identity
    first = _order(record_kernel, grid, block_order=11)
    assert sorted(first) == identity  # every block exactly once
    assert first != identity  # the seed is applied, not ignored
    assert first == _shuffled(n, 11)  # the documented algorithm
    assert _order(record_kernel, grid, block_order=11) == first  # reproducible
    other = _order(record_kernel, grid, block_order=12)
    assert sorted(other) == identity
    assert other != first
    assert _order(record_kernel, grid, block_order=np.int64(12)) == other


def test_error_names_the_block_under_a_shuffled_order(record_kernel: EmulatedKernel) -> None:
    grid, trap = (4, 3), 2 + 4 * 1  # block (2,1,0)
    order = _shuffled(12, 5)
    assert order.index(trap) not in (0, 11, trap)  # neither first, last, nor its in-order place
    counter = np.zeros(1, np.int32)
    out = np.full(12, -1, np.int32)
    with pytest.raises(EmulatorLaunchError, match=r"in block \(2,1,0\) thread \(5,0,0\)"):
        record_kernel(grid=grid, block=32, args=[counter, out, trap], block_order=5)
    # The blocks before it ran, in the shuffled order; none after it.
    ran = order[: order.index(trap) + 1]
    assert int(counter[0]) == len(ran)
    assert out[: len(ran)].tolist() == ran
    assert (out[len(ran) :] == -1).all()


# Magnitudes far apart: float32 addition of these is not associative (1e8 + 1 == 1e8).
SUM_INPUTS = np.array([1e8, 1, -1e8, 1, 1e8, 0.5, -1e8, 3], np.float32)


def _fold(order: list[int]) -> np.float32:
    total = np.float32(0)
    for b in order:
        total = np.float32(total + SUM_INPUTS[b])
    return total


def _atomic_sum(kern: EmulatedKernel, block_order: int | None) -> np.float32:
    total = np.zeros(1, np.float32)
    kern(grid=len(SUM_INPUTS), block=32, args=[SUM_INPUTS, total], block_order=block_order)
    return total[0]


def test_float_atomics_depend_on_block_order(sum_kernel: EmulatedKernel) -> None:
    n = len(SUM_INPUTS)
    in_order = _atomic_sum(sum_kernel, None)
    assert in_order.tobytes() == _atomic_sum(sum_kernel, 0).tobytes()  # bitwise reproducible
    assert in_order.tobytes() == _fold(list(range(n))).tobytes()
    results = {0: in_order.tobytes()}
    for seed in range(1, 9):
        got = _atomic_sum(sum_kernel, seed)
        assert got.tobytes() == _fold(_shuffled(n, seed)).tobytes(), seed
        assert got.tobytes() == _atomic_sum(sum_kernel, seed).tobytes(), seed
        results[seed] = got.tobytes()
    # The same kernel, the same inputs: the block order alone changes the bits.
    assert len(set(results.values())) >= 3, results


def test_env_variable_sets_the_default_order(
    record_kernel: EmulatedKernel, monkeypatch: pytest.MonkeyPatch
) -> None:
    grid = (4, 2)
    monkeypatch.setenv(ENV, "7")
    assert _order(record_kernel, grid) == _shuffled(8, 7) != list(range(8))
    assert _order(record_kernel, grid, block_order=0) == list(range(8))  # the call wins
    assert _order(record_kernel, grid, block_order=3) == _shuffled(8, 3)
    monkeypatch.setenv(ENV, "0")
    assert _order(record_kernel, grid) == list(range(8))
    monkeypatch.setenv(ENV, " ")
    assert _order(record_kernel, grid) == list(range(8))


@pytest.mark.parametrize("value", ["abc", "-3", "1.5", "0x10", str(2**63)])
def test_bad_env_value_raises_a_setting_error(
    record_kernel: EmulatedKernel, monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    monkeypatch.setenv(ENV, value)
    counter, out = np.zeros(1, np.int32), np.zeros(2, np.int32)
    with pytest.raises(EmulatorSettingError) as info:
        record_kernel(grid=2, block=32, args=[counter, out, -1])
    assert isinstance(info.value, SettingError)
    message = str(info.value)
    assert f"{ENV}={value!r}" in message
    assert "non-negative integer seed" in message
    assert counter[0] == 0  # nothing ran


def test_bad_block_order_argument(record_kernel: EmulatedKernel) -> None:
    counter, out = np.zeros(1, np.int32), np.zeros(2, np.int32)
    args = [counter, out, -1]
    with pytest.raises(EmulatorArgumentError, match="block_order=-1 is not allowed"):
        record_kernel(grid=2, block=32, args=args, block_order=-1)
    for bad in (1.5, "3", True):
        with pytest.raises(EmulatorArgumentTypeError, match="block_order must be"):
            record_kernel(grid=2, block=32, args=args, block_order=bad)  # type: ignore[arg-type]
    with pytest.raises(EmulatorArgumentError, match=f"shuffles at most {MAX_SHUFFLED_BLOCKS}"):
        record_kernel(grid=(MAX_SHUFFLED_BLOCKS + 1,), block=32, args=args, block_order=1)
    assert counter[0] == 0  # nothing ran


# Every thread adds: float and double atomicAdd (a compare-exchange loop) lose no update.
ADD_ALL_SRC = r"""
extern "C" __global__ void add_all(float* f, double* d, float* olds) {
  const float old = atomicAdd(f, 1.0f);
  atomicAdd(d, 0.5);
  olds[blockIdx.x * blockDim.x + threadIdx.x] = old;
}
"""


def test_float_atomic_add_from_every_thread() -> None:
    kern = build_kernel(
        ADD_ALL_SRC, "add_all", [("float*", "f"), ("double*", "d"), ("float*", "olds")]
    )
    f, d = np.zeros(1, np.float32), np.zeros(1, np.float64)
    olds = np.full(3 * 128, -1, np.float32)
    kern(grid=3, block=128, args=[f, d, olds], block_order=2)
    assert f[0] == 384 and d[0] == 192
    assert sorted(olds.tolist()) == list(range(384))  # each returned the value it replaced
