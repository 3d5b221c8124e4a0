"""The kernels the batch-invariant mode relies on (ops/batch_invariant.py), on the GPU:
one row's output must be bit-identical alone and in batches of 2, 9, 16, 33, 64 rows
(and 65, 130: the many-row EXL3 product in 64-row blocks), at any position in the batch.

- ``exl3_gemm`` (suh + Hadamard, the fused GEMM's split sums, output Hadamard + svh +
  bias): the lean loop's 1-8-row and 9-64-row instances decode the same float16 weights
  and run the same mma sequence per row; the mode pins the split count.
- ``padded_linear``: a dense head (tied embedding) through cuBLAS on 64-row blocks;
  ``RMSNorm`` (the final norm) through torch's kernel on 64-row blocks.
- ``paged_attention``: a row's result over a bigger page bucket (more, empty chunks).
"""

from __future__ import annotations

import pytest
import torch

from exl3cli.ops import batch_invariant as mode
from exl3cli.ops import cuda_kernels as kernels

pytestmark = pytest.mark.cuda

ROWS = [2, 9, 16, 33, 64, 65, 130]
CASES = [(4, "mul1"), (2, "mul1"), (3, "mul1"), (5, "mul1"), (6, "mul1"), (4, "mcg"),
         (4, "3inst")]
SHAPES = [(576, 1536), (1536, 576), (576, 192), (4096, 4096)]  # SmolLM2 and 8B widths


def _tiles(n: int) -> int:
    """16-wide tiles of a trellis side: the format pads every side to a multiple of 128
    (SmolLM2's 576 is stored as 640; the kernels refuse anything else)."""
    return -(-n // 128) * 8


@pytest.fixture(autouse=True)
def invariant_on():
    assert torch.cuda.is_available(), "cuda tests need a GPU"
    assert kernels.available(), f"extension did not load: {kernels.unavailable_reason()}"
    mode.set_batch_invariant(True)
    yield
    mode.set_batch_invariant(None)


def _batch(x: torch.Tensor, probe: torch.Tensor, rows: int, at: int) -> torch.Tensor:
    """`rows` rows: random ones from x with `probe` at row `at`."""
    batch = x[:rows].clone()
    batch[at] = probe
    return batch


@pytest.mark.parametrize(("k", "codebook"), CASES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_exl3_gemm_rows_do_not_depend_on_the_batch(k, codebook, shape, dtype):
    n_in, n_out = shape
    gen = torch.Generator().manual_seed(n_in + n_out + int(4 * k) + len(codebook))
    k2 = int(2 * k)
    trellis = torch.randint(-32768, 32768, (_tiles(n_in), _tiles(n_out), 8 * k2),
                            dtype=torch.int16, generator=gen).cuda()
    suh = (torch.randint(0, 2, (n_in,), generator=gen) * 2 - 1).float().cuda()
    svh = (torch.rand(n_out, generator=gen) * 0.02 + 0.01).cuda()
    bias = torch.randn(n_out, generator=gen).cuda()
    x = torch.randn(max(ROWS), n_in, generator=gen).to("cuda", dtype)
    probe = torch.randn(n_in, generator=gen).to("cuda", dtype)
    alone = kernels.exl3_gemm(probe[None], trellis, suh, svh, k, codebook, bias=bias)
    for rows in ROWS:
        for at in sorted({0, rows // 2, rows - 1}):
            out = kernels.exl3_gemm(_batch(x, probe, rows, at), trellis, suh, svh, k,
                                    codebook, bias=bias)
            assert torch.equal(out[at : at + 1], alone), (rows, at)


def test_many_rows_in_the_mode_equal_the_fused_rows_and_the_reference():
    gen = torch.Generator().manual_seed(7)
    trellis = torch.randint(-32768, 32768, (_tiles(576), 96, 64), dtype=torch.int16,
                            generator=gen)
    suh = (torch.randint(0, 2, (576,), generator=gen) * 2 - 1).float()
    svh = torch.rand(1536, generator=gen) * 0.02 + 0.01
    x = torch.randn(200, 576, generator=gen)
    want = kernels.exl3_gemm(x, trellis, suh, svh, 4)  # CPU: the reference
    got = kernels.exl3_gemm(x.cuda(), trellis.cuda(), suh.cuda(), svh.cuda(), 4)
    torch.testing.assert_close(got.cpu(), want, rtol=1e-3, atol=1e-3)
    blocks = torch.cat([kernels.exl3_gemm(x[i : i + 64].cuda(), trellis.cuda(), suh.cuda(),
                                          svh.cuda(), 4) for i in range(0, 200, 64)])
    assert torch.equal(got, blocks)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_padded_linear_rows_do_not_depend_on_the_batch(dtype):
    gen = torch.Generator().manual_seed(3)
    weight = (torch.randn(49152, 576, generator=gen) * 0.05).to("cuda", dtype)  # SmolLM2 head
    x = torch.randn(max(ROWS), 576, generator=gen).to("cuda", dtype)
    probe = torch.randn(576, generator=gen).to("cuda", dtype)
    alone = mode.padded_linear(probe[None], weight)
    for rows in ROWS:
        for at in sorted({0, rows - 1}):
            got = mode.padded_linear(_batch(x, probe, rows, at), weight)
            assert torch.equal(got[at : at + 1], alone), (rows, at)


@pytest.mark.parametrize("width", [576, 4096])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_rms_norm_rows_do_not_depend_on_the_batch(width, dtype):
    from exl3cli.engine.layers.norm import RMSNorm

    gen = torch.Generator().manual_seed(width)
    norm = RMSNorm(torch.rand(width, generator=gen).to("cuda", dtype) + 0.5, 1e-5)
    x = (torch.randn(max(ROWS), width, generator=gen) * 3).to("cuda", dtype)
    probe = (torch.randn(width, generator=gen) * 3).to("cuda", dtype)
    alone = norm(probe[None])
    for rows in ROWS:
        assert torch.equal(norm(_batch(x, probe, rows, rows - 1))[rows - 1 :], alone), rows


@pytest.mark.parametrize("bits", [16, 4])
def test_paged_attention_rows_do_not_depend_on_the_batch_or_page_bucket(bits):
    from exl3cli.engine.kvcache.kv_quant import resolve_kv_cache_type
    from exl3cli.engine.kvcache.paged_cache import PagePool

    heads, kv_heads, dim, size = 9, 3, 64, 256
    pool = PagePool(12, 1, kv_heads, dim, torch.bfloat16, "cuda",
                    resolve_kv_cache_type("fp16" if bits == 16 else "q4"))
    gen = torch.Generator().manual_seed(bits)
    slots = torch.arange(12 * size, device="cuda")
    pool.write(0, slots, *(torch.randn(12 * size, kv_heads, dim, generator=gen)
                           .to("cuda", torch.bfloat16) for _ in range(2)))
    keys, values = pool.keys[0], pool.values[0]
    probe = torch.randn(heads, dim, generator=gen).to("cuda", torch.bfloat16)
    kb, vb = pool.cache_type.key_bits, pool.cache_type.value_bits

    def attend(batch: int, pages: int, at: int) -> torch.Tensor:
        query = torch.randn(batch, heads, dim, generator=gen).to("cuda", torch.bfloat16)
        query[at] = probe
        table = torch.randint(0, 12, (batch, pages), generator=gen).cuda()
        table[at, :2] = torch.tensor([5, 2])
        lengths = torch.randint(1, pages * size + 1, (batch,), generator=gen).cuda()
        lengths[at] = 300  # two pages
        out = kernels.paged_attention(query, keys, values, kb, vb, table, lengths, size, None)
        return out[at : at + 1]

    alone = attend(1, 2, 0)
    for batch, pages in [(2, 2), (9, 4), (16, 2), (33, 8), (64, 3)]:
        assert torch.equal(attend(batch, pages, batch // 2), alone), (batch, pages)
