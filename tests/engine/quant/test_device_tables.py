"""``codec.device_tables.on_device``: a constant table is copied once per device/dtype."""

from __future__ import annotations

import pytest
import torch

from exl3cli.codec.device_tables import on_device
from exl3cli.codec.hadamard import hadamard_matrix
from exl3cli.codec.tiles import position_to_step


def test_cpu_table_is_itself_and_a_dtype_copy_is_kept():
    table = position_to_step()
    assert on_device(table, "cpu") is table
    wide = on_device(table, "cpu", torch.float64)
    assert wide.dtype == torch.float64 and torch.equal(wide, table.double())
    assert on_device(table, "cpu", torch.float64) is wide


def test_each_table_gets_its_own_copy():
    first = torch.arange(4)
    copy = on_device(first, "cpu", torch.float32)
    second = torch.arange(4) * 2
    assert torch.equal(on_device(second, "cpu", torch.float32), second.float())
    assert on_device(first, "cpu", torch.float32) is copy


@pytest.mark.cuda
def test_cuda_copy_is_made_once_and_reused_without_a_sync():
    h = hadamard_matrix(128)
    on_gpu = on_device(h, "cuda")
    assert on_gpu.is_cuda and torch.equal(on_gpu.cpu(), h)
    torch.cuda.set_sync_debug_mode("error")
    try:
        again = on_device(h, torch.device("cuda", torch.cuda.current_device()))
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert torch.equal(again.cpu(), h)
