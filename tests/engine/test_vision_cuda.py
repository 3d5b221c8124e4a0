"""Images in, text out on CUDA (`-m cuda`): the Qwen2.5-VL vision tower (window and
full attention, 2-D rotary, merger) and the Gemma 3 SigLIP tower + projector, and the
Qwen2.5-VL language model with images in the prompt (M-RoPE), each against the CPU
reference path on the tiny random folders (float32: max abs diff < 1e-3); the tower in
float16 on CUDA still tracks float32; the generator's greedy answers about images are
the CPU's, decoding through CUDA graphs (M-RoPE offsets per row) or without.

Collected everywhere, run only where a GPU is (pyproject deselects `cuda` by default).
"""

from __future__ import annotations

import pytest
import torch

from exl3cli.engine.generation.generator import Generator
from exl3cli.engine.generation.jobs import GenerationJob
from exl3cli.engine.generation.textmodel import TextModel
from exl3cli.engine.models.vision.image_processor import decode_image
from tests.fixtures.tiny_vision import image_bytes, write_tiny_gemma3_vision, write_tiny_qwen2_5_vl

pytestmark = pytest.mark.cuda
TOLERANCE = 1e-3
# 84 x 196 pixels after smart_resize: 3 x 7 tokens; 130 x 70 -> 5 x 3 (a cut window).
IMAGES = [image_bytes(200, 90, "JPEG", seed=2), image_bytes(70, 130, "PNG", seed=3)]


@pytest.fixture(scope="module")
def qwen(tmp_path_factory) -> dict[str, TextModel]:
    folder = write_tiny_qwen2_5_vl(tmp_path_factory.mktemp("qwen-vl-cuda") / "model")
    return {"cpu": TextModel.load(folder, device="cpu", dtype=torch.float32),
            "cuda": TextModel.load(folder, device="cuda", dtype=torch.float32),
            "half": TextModel.load(folder, device="cuda", dtype=torch.float16)}


def _prompt(loaded: TextModel, images: list[bytes]) -> list[int]:
    marks = " and ".join([loaded.vision.placeholder] * len(images))
    chat = f"<|im_start|>user\n{marks} what is it?<|im_end|>\n<|im_start|>assistant\n"
    return loaded.vision.prompt_ids(chat, images, loaded.tokenizer.encode)


@pytest.mark.parametrize("index", range(len(IMAGES)))
def test_qwen_tower_matches_the_cpu(qwen, index):
    pixels = qwen["cpu"].vision.processor(decode_image(IMAGES[index]))
    want = qwen["cpu"].vision.vision.embed_image(pixels)
    got = qwen["cuda"].vision.vision.embed_image(pixels)
    assert got.is_cuda and got.shape == want.shape
    assert (got.cpu() - want).abs().max() < TOLERANCE
    half = qwen["half"].vision.vision.embed_image(pixels).float().cpu()
    corr = torch.corrcoef(torch.stack([half.flatten(), want.flatten()]))[0, 1]
    assert corr > 0.999, f"float16 tower correlation {corr:.5f}"


def test_qwen_logits_with_images_match_the_cpu(qwen):
    ids = _prompt(qwen["cpu"], IMAGES)
    assert _prompt(qwen["cuda"], IMAGES) == ids
    want = qwen["cpu"].model(torch.tensor([ids]))
    got = qwen["cuda"].model(torch.tensor([ids]).cuda()).cpu()
    assert (got - want).abs().max() < TOLERANCE


@pytest.mark.parametrize("mode", ["graph", "off"])
def test_qwen_greedy_answers_about_images_are_the_cpus(qwen, mode):
    """CUDA-graph decode steps (rows with M-RoPE offsets after their images, and a
    text-only row beside them) and the general paged path both give the CPU's tokens."""
    answers = {}
    for name, decode in (("cpu", "off"), ("cuda", mode)):
        loaded = qwen[name]
        generator = Generator(loaded.model, loaded.tokenizer, max_batch=4, num_ctx=512,
                              decode_mode=decode)
        prompts = [_prompt(loaded, IMAGES[:1]), _prompt(loaded, IMAGES),
                   loaded.tokenizer.encode("The quick brown fox")]
        handles = [generator.submit(GenerationJob(ids, {"temperature": 0}, num_predict=8,
                                                  ignore_eos=True)) for ids in prompts]
        generator.run_until_done()
        answers[name] = [[t for event in h.iter_events() for t in event.token_ids]
                         for h in handles]
        if name == "cuda":
            assert generator.decode.mode == mode
            assert (generator.decode.graph_count > 0) == (mode == "graph")
    assert [len(tokens) for tokens in answers["cpu"]] == [8, 8, 8]
    assert answers["cuda"] == answers["cpu"]


def test_gemma3_tower_projector_and_graph_decode_match_the_cpu(tmp_path):
    """SigLIP + projector on CUDA; then an answer about the image decoded through CUDA
    graphs (decode steps embed text only: no device check for image ids to capture)."""
    folder = write_tiny_gemma3_vision(tmp_path / "gemma3")
    cpu = TextModel.load(folder, device="cpu", dtype=torch.float32)
    gpu = TextModel.load(folder, device="cuda", dtype=torch.float32)
    image = image_bytes(80, 60, "JPEG", seed=4)
    want, got = cpu.vision.encode(image), gpu.vision.encode(image)
    assert got.is_cuda and got.shape == want.shape
    assert (got.cpu() - want).abs().max() < TOLERANCE
    answers = []
    for loaded, mode in ((cpu, "off"), (gpu, "graph")):
        text = (f"<start_of_turn>user\n{loaded.vision.placeholder} Describe it.<end_of_turn>\n"
                "<start_of_turn>model\n")
        ids = loaded.vision.prompt_ids(text, [image], loaded.tokenizer.encode)
        generator = Generator(loaded.model, loaded.tokenizer, max_batch=2, num_ctx=512,
                              decode_mode=mode)
        handle = generator.submit(GenerationJob(ids, {"temperature": 0}, num_predict=8,
                                                ignore_eos=True))
        answers.append([t for event in handle.iter_events() for t in event.token_ids])
        assert generator.decode.mode == mode
    assert len(answers[0]) == 8 and answers[1] == answers[0]
