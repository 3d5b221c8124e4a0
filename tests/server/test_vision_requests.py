"""Images through a real `exl3 serve` on 127.0.0.1 with the official clients: the
`ollama` client's images (generate and chat, file paths and base64) and the `openai`
client's image_url data URLs reach a Gemma 3 and a Qwen2.5-VL image-text model and get
answers; the same image in a follow-up turn is not encoded again; a text-only model and
remote image URLs are refused with 400."""

from __future__ import annotations

import base64

import ollama
import openai
import pytest

from tests.fixtures.tiny_store import make_tiny_store
from tests.fixtures.tiny_vision import (
    TOKENS_PER_IMAGE,
    image_bytes,
    write_tiny_gemma3_vision,
    write_tiny_qwen2_5_vl,
)

GREEDY = {"temperature": 0, "num_predict": 4}


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    root = tmp_path_factory.mktemp("vision_requests")
    store = make_tiny_store(root)  # "tiny": text only
    folder = write_tiny_gemma3_vision(root / "vision-src")
    store.import_folder("vision", folder, {"type": "folder", "path": str(folder)})
    qwen = write_tiny_qwen2_5_vl(root / "qwen-vision-src")
    store.import_folder("qwen-vision", qwen, {"type": "folder", "path": str(qwen)})
    return store


@pytest.fixture(scope="module")
def client(daemon):
    return ollama.Client(host=daemon.url)


@pytest.fixture(scope="module")
def oai(daemon):
    return openai.OpenAI(base_url=daemon.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture
def png(tmp_path):
    path = tmp_path / "cat.png"
    path.write_bytes(image_bytes(120, 80, "PNG", seed=11))
    return path


def _encoded(daemon, model: str = "vision") -> int:
    runner = daemon.manager.runner
    loaded = runner.loaded_model(model)
    return loaded.text_model.model.images.encoded


def test_show_names_the_vision_capability(client):
    assert client.show("vision").capabilities == ["completion", "vision"]
    assert client.show("qwen-vision").capabilities == ["completion", "vision"]
    assert client.show("tiny").capabilities == ["completion"]


def test_ollama_generate_with_an_image_file(client, png):
    plain = client.generate(model="vision", prompt="what is in this?", options=GREEDY)
    answer = client.generate(model="vision", prompt="what is in this?", images=[png],
                             options=GREEDY)
    assert answer.done and isinstance(answer.response, str) and answer.eval_count == 4
    # boi + soft tokens + eoi and the blank lines around them
    assert answer.prompt_eval_count >= plain.prompt_eval_count + TOKENS_PER_IMAGE + 2


def test_ollama_chat_follow_up_does_not_encode_again(client, daemon, png):
    data = base64.b64encode(png.read_bytes()).decode()
    turn = [{"role": "user", "content": "Describe this.", "images": [data]}]
    first = client.chat(model="vision", messages=turn, options=GREEDY)
    assert first.done and first.message.role == "assistant"
    encoded = _encoded(daemon)
    follow = turn + [{"role": "assistant", "content": first.message.content},
                     {"role": "user", "content": "And the colours?"}]
    second = client.chat(model="vision", messages=follow, options=GREEDY)
    assert second.done
    assert _encoded(daemon) == encoded
    streamed = list(client.chat(model="vision", messages=turn, options=GREEDY, stream=True))
    assert streamed[-1].done
    assert "".join(c.message.content for c in streamed) == first.message.content


def test_openai_image_url_data_url(oai, client, png):
    url = "data:image/png;base64," + base64.b64encode(png.read_bytes()).decode()
    reply = oai.chat.completions.create(
        model="vision", max_tokens=4, temperature=0,
        messages=[{"role": "user", "content": [
            {"type": "text", "text": "Describe this."},
            {"type": "image_url", "image_url": {"url": url}}]}])
    assert reply.choices[0].message.content is not None
    same = client.chat(model="vision", options=GREEDY, messages=[
        {"role": "user", "content": "Describe this.",
         "images": [base64.b64encode(png.read_bytes()).decode()]}])
    assert reply.choices[0].message.content == same.message.content
    assert reply.usage.prompt_tokens == same.prompt_eval_count


def test_openai_remote_url_is_refused(oai):
    with pytest.raises(openai.BadRequestError, match="remote image URLs are not fetched"):
        oai.chat.completions.create(
            model="vision", max_tokens=2,
            messages=[{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}]}])


def test_text_only_model_refuses_images(client, oai, png):
    with pytest.raises(ollama.ResponseError) as error:
        client.generate(model="tiny", prompt="what is this?", images=[png])
    assert error.value.status_code == 400 and "does not support images" in error.value.error
    url = "data:image/png;base64," + base64.b64encode(png.read_bytes()).decode()
    with pytest.raises(openai.BadRequestError, match="does not support images"):
        oai.chat.completions.create(model="tiny", max_tokens=2, messages=[
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}])


def test_undecodable_image_is_a_400(client):
    with pytest.raises(ollama.ResponseError) as error:
        client.generate(model="vision", prompt="what?",
                        images=[base64.b64encode(b"not an image at all").decode()])
    assert error.value.status_code == 400 and "could not be decoded" in error.value.error
    answer = client.generate(model="vision", prompt="still fine?", options=GREEDY)
    assert answer.done  # one failing request harms no other


def test_qwen2_5_vl_images_through_ollama_and_openai(client, oai, daemon, png):
    """The 120 x 80 PNG is resized to 112 x 84 pixels: 3 x 4 tokens (M-RoPE positions),
    between <|vision_start|> and <|vision_end|>."""
    plain = client.generate(model="qwen-vision", prompt="what is in this?", options=GREEDY)
    answer = client.generate(model="qwen-vision", prompt="what is in this?", images=[png],
                             options=GREEDY)
    assert answer.done and answer.eval_count == 4
    assert answer.prompt_eval_count == plain.prompt_eval_count + 12 + 2
    data = base64.b64encode(png.read_bytes()).decode()
    turn = [{"role": "user", "content": "Describe this.", "images": [data]}]
    first = client.chat(model="qwen-vision", messages=turn, options=GREEDY)
    encoded = _encoded(daemon, "qwen-vision")
    follow = turn + [{"role": "assistant", "content": first.message.content},
                     {"role": "user", "content": "And the colours?"}]
    assert client.chat(model="qwen-vision", messages=follow, options=GREEDY).done
    assert _encoded(daemon, "qwen-vision") == encoded  # the image was not encoded again
    reply = oai.chat.completions.create(
        model="qwen-vision", max_tokens=4, temperature=0,
        messages=[{"role": "user", "content": [
            {"type": "text", "text": "Describe this."},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64," + data}}]}])
    assert reply.choices[0].message.content == first.message.content
    assert reply.usage.prompt_tokens == first.prompt_eval_count
