"""Qwen2.5-VL image-text against transformers' Qwen2_5_VLForConditionalGeneration: the
prompt spells each image as the processor does, its M-RoPE positions are get_rope_index's,
and the logits with images in the prompt are transformers' (fp32) without a cache,
through the paged cache in chunks (one starting inside an image) and in the decode steps
after it; through the generator, answers are transformers' greedy ones and a follow-up
turn reuses the image's pages."""

from __future__ import annotations

import pytest
import torch

from exl3cli.engine.generation.generator import Generator
from exl3cli.engine.generation.jobs import GenerationJob
from exl3cli.engine.generation.textmodel import TextModel
from exl3cli.engine.kvcache.paged_attention import PagedBatch
from exl3cli.engine.kvcache.paged_cache import PagePool, PageTable
from exl3cli.engine.models.vision.image_processor import decode_image
from tests.fixtures.tiny_vision import (
    QWEN_PREPROCESSOR,
    image_bytes,
    tiny_qwen2_5_vl_reference,
    write_tiny_qwen2_5_vl,
)

TOLERANCE = 1e-3
IMAGES = [image_bytes(64, 48, "PNG", seed=1), image_bytes(200, 90, "JPEG", seed=2),
          image_bytes(70, 130, "WEBP", seed=3)]
LONG = " ".join(["The quick brown fox jumps over the lazy dog."] * 30)


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    folder = write_tiny_qwen2_5_vl(tmp_path_factory.mktemp("qwen2_5_vl") / "model")
    return TextModel.load(folder, device="cpu", dtype=torch.float32)


@pytest.fixture(scope="module")
def reference():
    return tiny_qwen2_5_vl_reference()[0]


def _prompt(loaded, images, text="The quick brown fox {} what is the sky? Hello"):
    marks = " and ".join([loaded.vision.placeholder] * len(images))
    chat = f"<|im_start|>user\n{text.format(marks)}<|im_end|>\n<|im_start|>assistant\n"
    return loaded.vision.prompt_ids(chat, images, loaded.tokenizer.encode)


def _reference_inputs(reference, loaded, ids, images):
    """transformers' inputs for our prompt: image ids back to its image token, the
    processor's pixels and grids, mm_token_type_ids."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    ids = torch.tensor([ids])
    is_image = ids >= loaded.model.config.vocab_size
    processor = Qwen2VLImageProcessorPil(**{k: v for k, v in QWEN_PREPROCESSOR.items()
                                            if k != "image_processor_type"})
    pixels = processor([decode_image(b) for b in images], return_tensors="pt")
    return {"input_ids": ids.masked_fill(is_image, loaded.vision.image_token_id),
            "pixel_values": pixels["pixel_values"], "image_grid_thw": pixels["image_grid_thw"],
            "mm_token_type_ids": is_image.int()}


def _reference_logits(reference, loaded, ids, images):
    with torch.no_grad():
        return reference(**_reference_inputs(reference, loaded, ids, images)).logits.float()


def test_prompt_spells_each_image_as_the_processor(loaded):
    ids = _prompt(loaded, IMAGES[:2])
    runs = loaded.model.images.runs(ids)
    grids = [loaded.vision.token_grid(b) for b in IMAGES[:2]]
    assert grids == [(2, 2), (3, 7)]  # 56 x 56 and 84 x 196 pixels after smart_resize
    assert [end - begin for begin, end in runs] == [r * c for r, c in grids]
    tok = loaded.tokenizer
    for begin, end in runs:
        assert ids[begin - 1] == tok.token_to_id("<|vision_start|>")
        assert ids[end] == tok.token_to_id("<|vision_end|>")


def test_positions_equal_get_rope_index(loaded, reference):
    ids = _prompt(loaded, IMAGES)
    inputs = _reference_inputs(reference, loaded, ids, IMAGES)
    expected, deltas = reference.model.get_rope_index(
        inputs["input_ids"], inputs["mm_token_type_ids"], inputs["image_grid_thw"])
    held = loaded.model.images
    assert torch.equal(held.rope_positions(torch.tensor([ids])), expected)
    # Decode tokens after the prompt: 1-D positions continuing from the highest + 1.
    after = held.positions(ids, [5, 6])
    start = len(ids) + int(deltas[0, 0])
    assert after.tolist() == [[start, start + 1]] * 3


@pytest.mark.parametrize("count", [1, 3])
def test_logits_match_transformers_without_cache(loaded, reference, count):
    ids = _prompt(loaded, IMAGES[:count])
    expected = _reference_logits(reference, loaded, ids, IMAGES[:count])
    got = loaded.model(torch.tensor([ids]))
    assert got.shape == expected.shape
    assert (got - expected).abs().max() < TOLERANCE  # measured ~7e-6


def test_mrope_positions_matter(loaded, reference):
    ids = _prompt(loaded, IMAGES[1:2])
    expected = _reference_logits(reference, loaded, ids, IMAGES[1:2])
    held = loaded.model.images
    try:  # the same embeddings at their cache positions: no longer transformers'
        held.rope_positions = lambda input_ids: None
        plain = loaded.model(torch.tensor([ids]))
    finally:
        del held.rope_positions
    assert (plain - expected).abs().max() > 0.01


@pytest.mark.parametrize("split", [0, 3, -5])
def test_paged_chunks_and_decode_match_transformers(loaded, reference, split):
    """The prompt in paged steps (split before an image's start, or 5 tokens inside its
    run, as a chunk after reused pages may start), then two decode steps: each step's
    last logits are transformers' at that position."""
    images = IMAGES[:2]
    ids = _prompt(loaded, images)
    expected = _reference_logits(reference, loaded, ids + [5, 9], images)[0]
    begin, _ = loaded.model.images.runs(ids)[1]
    model, config = loaded.model, loaded.model.config
    pool = PagePool(4, len(model.layers), config.num_kv_heads, config.head_dim,
                    torch.float32, torch.device("cpu"))
    table = PageTable(pool)
    assert table.admit(ids, len(ids) + 4)
    cut = begin - split
    steps = ([ids[:cut], ids[cut:]] if split else [ids]) + [[5], [9]]
    done = 0
    for chunk in steps:
        logits = model(torch.tensor([chunk]), PagedBatch(pool, [table], [chunk]),
                       last_logits_only=True)[0, 0]
        done += len(chunk)
        assert (logits - expected[done - 1]).abs().max() < TOLERANCE


def _greedy_reference(reference, loaded, ids, images, count):
    ids = list(ids)
    for _ in range(count):
        if images:
            logits = _reference_logits(reference, loaded, ids, images)
        else:
            with torch.no_grad():
                logits = reference(input_ids=torch.tensor([ids])).logits
        ids.append(int(logits[0, -1].argmax()))
    return ids[-count:]


def _run(generator, prompt, count):
    handle = generator.submit(GenerationJob(prompt, options={"temperature": 0},
                                            num_predict=count, ignore_eos=True))
    tokens = [t for event in handle.iter_events() for t in event.token_ids]
    return tokens, handle.final


@pytest.mark.parametrize("mode", ["off", "static"])
def test_generator_answers_are_transformers_greedy(loaded, reference, mode):
    """Decoding through the general paged steps ("off", the CPU default) and through the
    fixed-shape steps CUDA graphs replay ("static": the same step code, run eagerly),
    whose rows carry rotary offsets after images; a text-only job shares the batch."""
    prompts = [(_prompt(loaded, IMAGES[:2]), IMAGES[:2]), (_prompt(loaded, IMAGES[2:]), IMAGES[2:]),
               (loaded.tokenizer.encode("The quick brown fox"), [])]
    generator = Generator(loaded.model, loaded.tokenizer, max_batch=3, num_ctx=512,
                          max_prefill_tokens=16, decode_mode=mode)
    assert generator.decode.mode == mode
    fixed_steps = []
    run = generator.decode.run
    generator.decode.run = lambda rows, ids=None: fixed_steps.append(len(rows)) or run(rows, ids)
    handles = [generator.submit(GenerationJob(ids, options={"temperature": 0}, num_predict=5,
                                              ignore_eos=True)) for ids, _ in prompts]
    generator.run_until_done()
    assert (3 in fixed_steps) == (mode == "static")  # all three rows in one fixed step
    for handle, (ids, images) in zip(handles, prompts, strict=True):
        tokens = [t for event in handle.iter_events() for t in event.token_ids]
        assert tokens == _greedy_reference(reference, loaded, ids, images, 5)


def test_decode_offset_is_the_shift_of_the_images_before(loaded):
    ids = _prompt(loaded, IMAGES[:2])
    held = loaded.model.images
    grids = [loaded.vision.token_grid(b) for b in IMAGES[:2]]  # (2, 2) and (3, 7)
    assert held.decode_offset(ids) == sum(max(r, c) - r * c for r, c in grids) == -2 - 14
    assert int(held.positions(ids, [5])[0, 0]) == len(ids) + held.decode_offset(ids)
    assert held.decode_offset(ids[:5]) == 0


def test_follow_up_turn_reuses_the_image_pages(loaded):
    image = IMAGES[1]
    first = _prompt(loaded, [image], text="{} " + LONG + " Describe it.")
    assert len(first) > 256  # the image sits in a full page the next turn can reuse
    generator = Generator(loaded.model, loaded.tokenizer, max_batch=1, num_ctx=1024)
    answer, done = _run(generator, first, 4)
    assert done.prompt_cache_count == 0
    encoded = loaded.model.images.encoded
    follow_up = first + answer + _prompt(loaded, [image], text="{} And now?")
    tokens, done = _run(generator, follow_up, 4)
    assert loaded.model.images.encoded == encoded  # not encoded again
    assert done.prompt_cache_count >= 256
    expected = list(follow_up)
    for _ in range(4):
        expected.append(int(loaded.model(torch.tensor([expected]))[0, -1].argmax()))
    assert tokens == expected[-4:]


def test_chat_messages_with_images(loaded):
    messages = [{"role": "user", "content": "What is this?", "images": [IMAGES[0]]}]
    ids = loaded.chat_prompt(messages)
    assert ids == _prompt(loaded, IMAGES[:1], text="{}What is this?")
    text = "".join(event.text for event in loaded.stream(ids, {"temperature": 0}, num_predict=3))
    assert isinstance(text, str)
