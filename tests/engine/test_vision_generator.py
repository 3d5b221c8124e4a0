"""Images through the generator: prompt chunks never split an image (its tokens see
each other), answers equal the whole-sequence forward, and a follow-up turn with the
same image reuses its cached pages without encoding it again."""

from __future__ import annotations

import pytest
import torch

from exl3cli.engine.generation.generator import Generator
from exl3cli.engine.generation.jobs import GenerationJob
from exl3cli.engine.generation.textmodel import TextModel
from tests.fixtures.tiny_vision import TOKENS_PER_IMAGE, image_bytes, write_tiny_gemma3_vision

LONG = " ".join(["The quick brown fox jumps over the lazy dog."] * 30)


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    folder = write_tiny_gemma3_vision(tmp_path_factory.mktemp("gemma3v") / "model")
    return TextModel.load(folder, device="cpu", dtype=torch.float32)


def _ids(loaded, text, images):
    return loaded.vision.prompt_ids(text, images, loaded.tokenizer.encode)


def _greedy_without_cache(model, ids, count):
    ids = list(ids)
    for _ in range(count):
        ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    return ids[-count:]


def _run(generator, prompt, count):
    handle = generator.submit(GenerationJob(prompt, options={"temperature": 0},
                                            num_predict=count, ignore_eos=True))
    events = list(handle.iter_events())
    tokens = [t for event in events for t in event.token_ids]
    return tokens, handle.final


@pytest.mark.parametrize("chunk", [5, 9, 512])
def test_chunked_prefill_equals_whole_sequence(loaded, chunk):
    prompt = _ids(loaded, "Hello <start_of_image> and <start_of_image> what now?",
                  [image_bytes(50, 40, seed=1), image_bytes(40, 50, "JPEG", seed=2)])
    expected = _greedy_without_cache(loaded.model, prompt, 6)
    generator = Generator(loaded.model, loaded.tokenizer, max_batch=2, num_ctx=512,
                          max_prefill_tokens=chunk)
    steps = []
    generator.step_observers.append(lambda report: steps.append(report.prefill_tokens))
    tokens, _ = _run(generator, prompt, 6)
    assert tokens == expected
    if chunk < TOKENS_PER_IMAGE:  # an image was fed whole, past the chunk size
        assert max(steps) >= TOKENS_PER_IMAGE


def test_follow_up_turn_reuses_the_image(loaded):
    image = image_bytes(64, 64, "PNG", seed=5)
    first = _ids(loaded, f"<start_of_image> {LONG} Describe it.", [image])
    assert len(first) > 256  # the image sits in a full page the next turn can reuse
    generator = Generator(loaded.model, loaded.tokenizer, max_batch=1, num_ctx=1024)
    answer, done = _run(generator, first, 4)
    assert done.prompt_cache_count == 0
    encoded = loaded.model.images.encoded
    follow_up = first + answer + _ids(loaded, "<start_of_image> And now?", [image])
    tokens, done = _run(generator, follow_up, 4)
    assert loaded.model.images.encoded == encoded  # the image was not encoded again
    assert done.prompt_cache_count >= 256  # its page came from the cache
    assert tokens == _greedy_without_cache(loaded.model, follow_up, 4)


def test_another_image_does_not_reuse_pages(loaded):
    text = f"<start_of_image> {LONG} Describe it."
    generator = Generator(loaded.model, loaded.tokenizer, max_batch=1, num_ctx=1024)
    _run(generator, _ids(loaded, text, [image_bytes(64, 64, seed=7)]), 2)
    _, done = _run(generator, _ids(loaded, text, [image_bytes(64, 64, seed=8)]), 2)
    assert done.prompt_cache_count == 0


def test_unknown_image_ids_fail_alone(loaded):
    from exl3cli.errors import InvalidOption

    generator = Generator(loaded.model, loaded.tokenizer, max_batch=1, num_ctx=512)
    vocab = loaded.model.config.vocab_size
    with pytest.raises(InvalidOption):
        generator.submit(GenerationJob([5, 6, vocab + 10_000], num_predict=2))
