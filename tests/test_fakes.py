"""CPU tier: the fakes of kernelgen/testing against the real libraries' behaviour where the tests
rely on it (values checked against NumPy and ml_dtypes)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from kernelgen.testing import fake_cupy, fake_torch


@pytest.mark.parametrize(
    ("dtype", "bits"),
    [(np.uint16, 0xFFFF), (ml_dtypes.bfloat16, 0xFFFF), (np.int32, -1), (np.float16, None)],
)
def test_backed_allocations_start_as_nan_or_all_ones(dtype, bits):
    host = fake_cupy.poisoned_host((3, 5), dtype)
    assert host.dtype == np.dtype(dtype) and host.shape == (3, 5)
    if dtype in (np.float16, ml_dtypes.bfloat16):
        assert np.isnan(host.astype(np.float32)).all()
    if bits is not None:
        assert (host.view(np.int32 if bits == -1 else np.uint16) == bits).all()


def test_torch_to_float32_converts_bfloat16_values_not_bits():
    fake_torch.module(backed=True)
    values = np.array([[1.5, -2.0, 3.0e-3, 65504.0]], np.float32)
    bits = values.astype(ml_dtypes.bfloat16).view(np.uint16)
    tensor = fake_torch.from_numpy(bits)
    assert tensor.dtype is fake_torch.bfloat16
    widened = tensor.to(fake_torch.float32)
    want = values.astype(ml_dtypes.bfloat16).astype(np.float32)
    assert widened.dtype is fake_torch.float32 and np.array_equal(widened.host, want)
    back = widened.to(fake_torch.bfloat16)
    assert back.dtype is fake_torch.bfloat16 and np.array_equal(back.host, bits)


def test_torchs_allocator_hands_a_freed_block_to_the_next_allocation():
    fake_torch.module()
    device = fake_torch.device("cuda", 0)
    first = fake_torch.empty((100, 120), fake_torch.float32, device)
    freed = first.data_ptr()
    del first
    assert fake_torch.empty((8,), fake_torch.float32, device).data_ptr() == freed
