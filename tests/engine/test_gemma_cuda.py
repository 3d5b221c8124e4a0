"""Gemma 2 and Gemma 3 on CUDA (`-m cuda`): soft-capped attention and logits, sliding
windows (a 6-token window crossed many times), sandwich norms (four per layer) and the
local rope of Gemma 3, each against the CPU reference path on tiny random models.

Collected everywhere, run only where a GPU is (pyproject deselects `cuda` by default).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from exl3cli.codec.format import Exl3FolderWriter, make_quantization_config
from exl3cli.convert.synthetic import quantize_linear_plain
from exl3cli.engine.generation.generator import Generator
from exl3cli.engine.generation.jobs import GenerationJob
from exl3cli.engine.kvcache.attention_math import softcapped_attention
from exl3cli.engine.models.loader import load_causal_lm
from exl3cli.engine.models.weights import WeightReader
from exl3cli.engine.text.tokenizer import Tokenizer
from tests.fixtures.tiny_model import write_tiny_model
from tests.fixtures.tiny_tokenizer import write_tiny_tokenizer

pytestmark = pytest.mark.cuda
GEMMA2_CAPS = {"attn_logit_softcapping": 3.0, "final_logit_softcapping": 5.0}
CASES = {"gemma2": GEMMA2_CAPS, "gemma3": {}}
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gemma-cuda")
    made = {}
    for case, overrides in CASES.items():
        folder = write_tiny_model(root / case, case, vocab_size=400,
                                  max_position_embeddings=1024, **overrides)
        write_tiny_tokenizer(folder)
        made[case] = folder
    return made


def _ids(length: int, seed: int, batch: int = 1) -> torch.Tensor:
    return torch.randint(3, 400, (batch, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("case", sorted(CASES))
def test_whole_sequence_logits_match_the_cpu_in_float32(folders, case):
    cpu = load_causal_lm(folders[case], device="cpu", dtype=torch.float32)
    gpu = load_causal_lm(folders[case], device="cuda", dtype=torch.float32)
    ids = _ids(40, seed=1, batch=2)  # 40 tokens: the 6-token window slides far
    want = cpu(ids)
    got = gpu(ids.cuda()).cpu()
    assert (got - want).abs().max() < 1e-3
    if case == "gemma2":  # the final soft-cap holds on the GPU too
        assert got.abs().max() <= 5.0 + 1e-4


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("mode", ["off", "graph"])
def test_generator_greedy_tokens_match_the_cpu(folders, case, mode):
    """The paged generator (general path, and decode steps replayed from CUDA graphs)
    against the CPU generator, float32: jobs of several lengths, prompts past the
    window, joined and finished at different steps."""
    rng = random.Random(2)
    prompts = [[rng.randrange(3, 400) for _ in range(n)] for n in (3, 9, 40, 130, 300)]
    lengths = [25, 40, 17, 33, 30]

    def run(device: str, decode_mode: str | None) -> list[list[int]]:
        model = load_causal_lm(folders[case], device=device, dtype=torch.float32)
        tokenizer = Tokenizer.from_folder(folders[case])
        generator = Generator(model, tokenizer, max_batch=4, num_ctx=512,
                              decode_mode=decode_mode)
        handles = [generator.submit(GenerationJob(p, {"temperature": 0}, num_predict=n,
                                                  ignore_eos=True))
                   for p, n in zip(prompts, lengths, strict=True)]
        generator.run_until_done()
        assert generator.pool.pages_in_use == 0
        return [h.token_ids for h in handles]

    assert run("cuda", mode) == run("cpu", None)


@pytest.mark.parametrize("case", sorted(CASES))
def test_bfloat16_on_the_gpu_stays_close_to_the_cpu(folders, case):
    cpu = load_causal_lm(folders[case], device="cpu", dtype=torch.float32)
    gpu = load_causal_lm(folders[case], device="cuda", dtype=torch.bfloat16)
    # Gemma keeps its 1 + w norm weights in float32, also on the GPU.
    assert gpu.final_norm.weight.dtype == torch.float32
    ids = _ids(32, seed=3)
    want = cpu(ids)
    got = gpu(ids.cuda()).float().cpu()
    assert (got - want).abs().max() < 0.05 * want.abs().max()


def _exl3_folder(src: Path, out: Path) -> Path:
    reader = WeightReader(src)
    writer = Exl3FolderWriter(out, json.loads((src / "config.json").read_text()), 2**40)
    for key in reader.keys():
        module = key.rsplit(".", 1)[0]
        if module.rsplit(".", 1)[-1] in LINEARS:
            writer.add_linear_tensors(module, quantize_linear_plain(
                reader.get(key), 6, "mul1", None, seed=len(module)))
        else:
            writer.add_tensor(key, reader.get(key))
    writer.close(make_quantization_config(6, 6, "mul1"))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if (src / name).is_file():
            (out / name).write_bytes((src / name).read_bytes())
    return out


@pytest.mark.parametrize("case", sorted(CASES))
def test_exl3_gemma_on_the_gpu_matches_its_cpu_dequantized_load(folders, tmp_path, case):
    """EXL3 linears decoded in forward by the CUDA kernels (float16 activations) against
    the same folder dequantized at load on the CPU (float32)."""
    folder = _exl3_folder(folders[case], tmp_path / "exl3")
    cpu = load_causal_lm(folder, device="cpu", dtype=torch.float32)
    gpu = load_causal_lm(folder, device="cuda", dtype=torch.float16)
    ids = _ids(24, seed=4, batch=2)
    want = cpu(ids)
    got = gpu(ids.cuda()).float().cpu()
    assert torch.isfinite(got).all()
    assert (got - want).abs().max() < 0.03 * want.abs().max()
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() > 0.9


@pytest.mark.parametrize("block", [512, 3])
def test_softcapped_attention_on_the_gpu(block):
    gen = torch.Generator().manual_seed(5)
    query = torch.randn(2, 4, 7, 8, generator=gen) * 3
    key, value = torch.randn(2, 2, 10, 8, generator=gen) * 3, torch.randn(2, 2, 10, 8, generator=gen)
    positions = torch.arange(3, 10)[:, None]
    allowed = (torch.arange(10) <= positions) & (torch.arange(10) > positions - 4)
    want = softcapped_attention(query, key, value, allowed[None, None], 0.3, 2.0, block=block)
    got = softcapped_attention(query.cuda(), key.cuda(), value.cuda(),
                               allowed[None, None].cuda(), 0.3, 2.0, block=block)
    assert (got.cpu() - want).abs().max() < 1e-4


@pytest.mark.parametrize("case", sorted(CASES))
def test_prefix_cache_hits_in_graph_mode_give_the_first_runs_tokens(folders, case):
    """A prompt decoded once, then six copies at once that reuse its cached pages (what
    `exl3 serve` does when clients repeat a prompt): graphs replayed over shared pages,
    past the sliding window, must give the first run's tokens (float32)."""
    model = load_causal_lm(folders[case], device="cuda", dtype=torch.float32)
    tokenizer = Tokenizer.from_folder(folders[case])
    rng = random.Random(3)
    prompt = [rng.randrange(3, 400) for _ in range(300)]
    generator = Generator(model, tokenizer, max_batch=8, num_ctx=1024, decode_mode="graph")

    def job() -> GenerationJob:
        return GenerationJob(list(prompt), {"temperature": 0}, num_predict=40, ignore_eos=True)

    first = generator.submit(job())
    generator.run_until_done()
    again = [generator.submit(job()) for _ in range(6)]
    generator.run_until_done()
    assert generator.decode.mode == "graph" and generator.decode.captures >= 2
    assert [list(h.token_ids) for h in again] == [list(first.token_ids)] * 6
