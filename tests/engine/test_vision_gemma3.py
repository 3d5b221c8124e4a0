"""Gemma 3 image-text against transformers' Gemma3ForConditionalGeneration: the same
prompt with an image in it gives the same logits (fp32), without a cache and through
the paged cache in chunks; the bidirectional attention over image tokens matters."""

from __future__ import annotations

import pytest
import torch

from exl3cli.engine.generation.textmodel import TextModel
from exl3cli.engine.kvcache.paged_attention import PagedBatch
from exl3cli.engine.kvcache.paged_cache import PagePool, PageTable
from exl3cli.engine.models.vision.image_processor import decode_image
from tests.fixtures.tiny_vision import (
    TOKENS_PER_IMAGE,
    image_bytes,
    tiny_gemma3_vision_reference,
    write_tiny_gemma3_vision,
)

TOLERANCE = 1e-3
PROMPT = ("<start_of_turn>user\nThe quick brown fox <start_of_image> what is the "
          "sky? Hello world<end_of_turn>\n<start_of_turn>model\n")


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    folder = write_tiny_gemma3_vision(tmp_path_factory.mktemp("gemma3v") / "model")
    return TextModel.load(folder, device="cpu", dtype=torch.float32)


@pytest.fixture(scope="module")
def reference():
    return tiny_gemma3_vision_reference()[0]


def _reference_logits(reference, text_model, prompt_ids, images):
    """transformers' logits for our prompt: image ids back to its image token, the
    processor's pixels and token_type_ids."""
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    vision = text_model.vision
    vocab = text_model.model.config.vocab_size
    ids = torch.tensor([prompt_ids])
    is_image = ids >= vocab
    ids = ids.masked_fill(is_image, vision.image_token_id)
    processor = Gemma3ImageProcessorPil(**_processor_settings(vision.processor))
    pixels = processor([decode_image(b) for b in images], return_tensors="pt")["pixel_values"]
    with torch.no_grad():
        out = reference(input_ids=ids, pixel_values=pixels, token_type_ids=is_image.long())
    return out.logits.float()


def _processor_settings(processor):
    return {"size": {"height": processor.height, "width": processor.width},
            "image_mean": list(processor.image_mean), "image_std": list(processor.image_std),
            "resample": processor.resample, "rescale_factor": processor.rescale_factor}


def _prompt(loaded, images):
    """PROMPT with one image, or two side by side."""
    text = PROMPT if len(images) == 1 else PROMPT.replace(
        "<start_of_image>", "<start_of_image> and <start_of_image>")
    return loaded.vision.prompt_ids(text, images, loaded.tokenizer.encode)


def test_prompt_spells_the_image_as_transformers_processor(loaded):
    image = image_bytes(64, 48)
    ids = _prompt(loaded, [image])
    vocab = loaded.model.config.vocab_size
    runs = loaded.model.images.runs(ids)
    assert [end - begin for begin, end in runs] == [TOKENS_PER_IMAGE]
    begin, end = runs[0]
    tok = loaded.tokenizer
    assert ids[begin - 1] == tok.token_to_id("<start_of_image>")
    assert ids[end] == tok.token_to_id("<end_of_image>")
    assert tok.decode(ids[:begin - 1]).endswith("fox \n\n")
    assert all(i >= vocab for i in ids[begin:end])


@pytest.mark.parametrize("count", [1, 2])
def test_logits_match_transformers_without_cache(loaded, reference, count):
    images = [image_bytes(64, 48, "PNG", seed=1), image_bytes(90, 130, "JPEG", seed=2)][:count]
    ids = _prompt(loaded, images)
    expected = _reference_logits(reference, loaded, ids, images)
    got = loaded.model(torch.tensor([ids]))
    assert got.shape == expected.shape
    assert (got - expected).abs().max() < TOLERANCE  # measured 5e-6


def test_bidirectional_image_attention_matters(loaded, reference):
    images = [image_bytes(64, 48, seed=1)]
    ids = _prompt(loaded, images)
    expected = _reference_logits(reference, loaded, ids, images)
    images_held = loaded.model.images
    try:  # the same embeddings, causal attention over them: no longer transformers'
        images_held.block_ids = lambda input_ids: None
        causal = loaded.model(torch.tensor([ids]))
    finally:
        del images_held.block_ids
    assert (causal - expected).abs().max() > 0.01


@pytest.mark.parametrize("split", [0, 10])
def test_paged_chunks_match_transformers(loaded, reference, split):
    """The prompt in two paged steps (the second holds the whole image), then one
    decode step: each step's last logits are transformers' at that position."""
    images = [image_bytes(70, 70, "WEBP", seed=3)]
    ids = _prompt(loaded, images)
    expected = _reference_logits(reference, loaded, ids + [5], images)[0]
    begin, _ = loaded.model.images.runs(ids)[0]
    model = loaded.model
    config = model.config
    pool = PagePool(4, len(model.layers), config.num_kv_heads, config.head_dim,
                    torch.float32, torch.device("cpu"))
    table = PageTable(pool)
    assert table.admit(ids, len(ids) + 4)
    steps = [ids[:begin - split], ids[begin - split:], [5]] if split else [ids, [5]]
    done = 0
    for chunk in steps:
        logits = model(torch.tensor([chunk]), PagedBatch(pool, [table], [chunk]),
                       last_logits_only=True)[0, 0]
        done += len(chunk)
        assert (logits - expected[done - 1]).abs().max() < TOLERANCE


def test_same_image_is_encoded_once(loaded):
    held = loaded.model.images
    data = image_bytes(33, 77, "PNG", seed=9)
    before = held.encoded
    first = loaded.vision.image_ids(data)
    again = loaded.vision.image_ids(data)
    other = loaded.vision.image_ids(image_bytes(33, 77, "PNG", seed=10))
    assert first == again and held.encoded == before + 2
    assert set(first).isdisjoint(other)


def test_image_count_must_match_placeholders(loaded):
    from exl3cli.errors import InvalidOption

    with pytest.raises(InvalidOption, match="marks 1 image"):
        loaded.vision.prompt_ids(PROMPT, [], loaded.tokenizer.encode)
    with pytest.raises(InvalidOption, match="could not be decoded"):
        loaded.vision.prompt_ids(PROMPT, [b"not an image"], loaded.tokenizer.encode)
