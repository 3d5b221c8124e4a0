"""``viterbi_states_segments``: tiles in segments of their own K searched in one call
give the states of one call per segment (CPU: one call each; CUDA: one launch), and an
LDLQ block's quantizers never synchronise a GPU (conversion time, NOTES section 9)."""

from __future__ import annotations

import pytest
import torch

from exl3cli.convert.ldlq import trellis_block_quantizer, trellis_parts_quantizer
from exl3cli.ops import cuda_viterbi
from exl3cli.ops.viterbi import viterbi_states, viterbi_states_segments

SEGMENTS = [([3, 4], [5, 3]), ([4, 5, 3], [7, 2, 4]), ([1, 4], [2, 3]),
            ([2.5, 6, 2, 8], [3, 1, 2, 2]), ([4, 3], [0, 3])]


def _targets(seed: int, n: int) -> torch.Tensor:
    return torch.randn(n, 256, generator=torch.Generator().manual_seed(seed))


def _one_call_each(targets: torch.Tensor, k_bits: list, counts: list) -> torch.Tensor:
    parts = torch.split(targets, counts)
    return torch.cat([viterbi_states(t, k) for t, k in zip(parts, k_bits, strict=True)])


@pytest.mark.parametrize(("k_bits", "counts"), SEGMENTS)
def test_segments_match_one_call_each_cpu(k_bits, counts):
    targets = _targets(sum(counts), sum(counts))
    got = viterbi_states_segments(targets, k_bits, counts)
    assert torch.equal(got, _one_call_each(targets, k_bits, counts))


def test_segments_must_cover_the_tiles():
    with pytest.raises(ValueError, match="do not cover"):
        viterbi_states_segments(_targets(0, 4), [3, 4], [2, 1])
    with pytest.raises(ValueError):
        viterbi_states_segments(_targets(0, 4), [3, 4.25], [2, 2])


@pytest.mark.cuda
@pytest.mark.parametrize(("k_bits", "counts"), SEGMENTS + [([3, 5], [140, 9])])
def test_cuda_segments_match_one_launch_each(k_bits, counts):
    assert cuda_viterbi.available(), cuda_viterbi.unavailable_reason()
    targets = _targets(7 + sum(counts), sum(counts)).cuda()
    one = cuda_viterbi.viterbi_states_segments_cuda(targets, k_bits, counts)
    assert torch.equal(one.cpu(), _one_call_each(targets, k_bits, counts).cpu())
    assert torch.equal(viterbi_states_segments(targets, k_bits, counts).cpu(), one.cpu())


@pytest.mark.cuda
def test_ldlq_block_quantizers_do_not_sync_the_gpu():
    assert cuda_viterbi.available(), cuda_viterbi.unavailable_reason()
    rows = [torch.randn(16, w, device="cuda") for w in (128, 64)]
    single, parts = trellis_block_quantizer(4), trellis_parts_quantizer([3, 5])
    single(rows[0])
    parts(rows)  # warm: the constant tables reach the device once
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        values, packed = single(rows[0])
        joint = parts(rows)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert values.shape == (16, 128) and packed.shape == (1, 8, 64)
    assert [p.shape for _, p in joint] == [(1, 8, 48), (1, 4, 80)]
    for (v, p), r, k in zip(joint, rows, [3, 5], strict=True):
        alone_v, alone_p = trellis_block_quantizer(k)(r)
        assert torch.equal(v, alone_v) and torch.equal(p, alone_p)
