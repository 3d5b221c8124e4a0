"""Images from the command line: `exl3 run MODEL PROMPT --image FILE`, image paths in
the prompt or in a REPL message (as `ollama run` reads them), the Python API; a
text-only model refuses them with a one-line error."""

from __future__ import annotations

import base64
import io

import pytest
from click.testing import CliRunner
from prompt_toolkit.input import create_pipe_input
from prompt_toolkit.output import DummyOutput

from exl3cli.api import load
from exl3cli.cli import main
from exl3cli.cli.image_paths import extract_image_paths
from exl3cli.cli.repl import Repl
from exl3cli.cli.repl_commands import ReplOptions
from exl3cli.client.local import LocalClient
from tests.fixtures.tiny_store import make_tiny_store
from tests.fixtures.tiny_vision import image_bytes, write_tiny_gemma3_vision

GREEDY = {"temperature": 0, "num_predict": 5}


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    root = tmp_path_factory.mktemp("run_images")
    store = make_tiny_store(root)
    folder = write_tiny_gemma3_vision(root / "vision-src")
    store.import_folder("vision", folder, {"type": "folder", "path": str(folder)})
    modelfile = root / "Modelfile"
    modelfile.write_text("FROM vision\nPARAMETER temperature 0\nPARAMETER num_predict 5\n")
    result = CliRunner().invoke(main, ["create", "vision0", "-f", str(modelfile)],
                                env={"EXL3_MODELS": str(store.root)})
    assert result.exit_code == 0, result.output
    return store


@pytest.fixture(scope="module")
def client(store):
    return LocalClient(store)


@pytest.fixture(scope="module")
def cat(tmp_path_factory):
    path = tmp_path_factory.mktemp("pictures") / "my cat.png"
    path.write_bytes(image_bytes(90, 60, "PNG", seed=21))
    return path


def _answer(client, prompt, images):
    chunks = client.generate({"model": "vision0", "prompt": prompt, "images": [
        base64.b64encode(p.read_bytes()).decode() for p in images]})
    return "".join(c["response"] for c in chunks)


def exl3(store, *args):
    return CliRunner().invoke(main, list(args), env={"EXL3_MODELS": str(store.root),
                                                     "EXL3_HOST": "127.0.0.1:9"})


def test_run_with_image_option(store, client, cat):
    result = exl3(store, "run", "vision0", "what is in this?", "--image", str(cat))
    assert result.exit_code == 0, result.output
    expected = _answer(client, "what is in this?", [cat])
    assert result.stdout.rstrip("\n") == expected.rstrip("\n")
    seen = exl3(store, "run", "vision0", "what is in this?", "--image", str(cat), "--verbose")
    unseen = exl3(store, "run", "vision0", "what is in this?", "--verbose")
    # the image's soft tokens (and boi/eoi) were in the prompt the model read
    assert _prompt_count(seen.stderr) >= _prompt_count(unseen.stderr) + 16


def _prompt_count(stats: str) -> int:
    line = next(line for line in stats.splitlines() if line.startswith("prompt eval count"))
    return int(line.split(":")[1].split()[0])


def test_run_with_an_image_path_in_the_prompt(store, client, cat):
    escaped = str(cat).replace(" ", "\\ ")
    result = exl3(store, "run", "vision0", f"describe {escaped} please")
    assert result.exit_code == 0, result.output
    assert result.stdout.rstrip("\n") == _answer(client, "describe please", [cat]).rstrip("\n")


def test_text_only_model_and_missing_file_fail_clearly(store, cat, tmp_path):
    result = exl3(store, "run", "tiny", "what is this?", "--image", str(cat))
    assert result.exit_code == 1 and "does not support images" in result.stderr
    assert "Traceback" not in result.output
    missing = exl3(store, "run", "vision0", "hi", "--image", str(tmp_path / "none.png"))
    assert missing.exit_code == 2 and "does not exist" in missing.output


def test_extract_image_paths(cat, tmp_path):
    other = tmp_path / "dog.JPG"
    other.write_bytes(image_bytes(20, 20, "JPEG"))
    text, paths = extract_image_paths(f"compare '{cat}' and {other} now")
    assert paths == [cat, other] and text == "compare and now"
    assert extract_image_paths("a /no/such/file.png here") == ("a /no/such/file.png here", [])
    assert extract_image_paths(f"notes {tmp_path}")[1] == []  # a folder is text


def test_repl_message_with_an_image_path(client, cat, tmp_path):
    escaped = str(cat).replace(" ", "\\ ")
    keys = f"/set parameter temperature 0\r/set parameter num_predict 5\rwhat is {escaped}\r/bye\r"
    out = io.StringIO()
    with create_pipe_input() as pipe:
        pipe.send_text(keys)
        repl = Repl(client, ReplOptions(model="vision"), stdout=out, stderr=io.StringIO(),
                    pt_input=pipe, pt_output=DummyOutput(), history_file=tmp_path / "h")
        repl.run()
    question, answer = repl.session.messages
    assert question["content"] == "what is"
    assert base64.b64decode(question["images"][0]) == cat.read_bytes()
    assert f"Added image '{cat}'" in out.getvalue()
    chunks = client.chat({"model": "vision", "options": GREEDY, "messages": [question]})
    assert answer["content"] == "".join(c["message"]["content"] for c in chunks)


def test_python_api_images(store, client, cat):
    llm = load("vision", store_root=store.root, device="cpu", max_seq_len=512, max_batch=2)
    from_path = llm.generate("what is in this?", images=[str(cat)], max_tokens=5, temperature=0)
    from_bytes = llm.generate("what is in this?", images=[cat.read_bytes()], max_tokens=5,
                              temperature=0)
    assert from_path == from_bytes
    assert llm.model.images.encoded == 1  # the same image, encoded once
    chat = llm.chat([{"role": "user", "content": "hi", "images": [cat.read_bytes()]}],
                    max_tokens=5, temperature=0)
    assert isinstance(chat, str)
    with pytest.raises(TypeError, match="images= goes with a text prompt"):
        llm.generate([{"role": "user", "content": "hi"}], images=[str(cat)])
    text_only = load("tiny", store_root=store.root, device="cpu", max_seq_len=256, max_batch=1)
    from exl3cli.errors import InvalidOption

    with pytest.raises(InvalidOption, match="does not support images"):
        text_only.generate("hi", images=[str(cat)])
