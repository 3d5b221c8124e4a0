"""`create` refuses a Modelfile that could never run, naming its line: Ollama (Go)
templates and broken Jinja, unknown drafts and drafts with another vocabulary, an
architecture no plugin supports, a missing ADAPTER (tests/client/test_adapters.py: the rest)."""

from __future__ import annotations

import json

import pytest

from exl3cli.client.local import LocalClient
from exl3cli.errors import ModelfileError
from exl3cli.runtime.create_checks import looks_like_go_template
from tests.fixtures.tiny_store import write_tiny_chat_model

GO_TEMPLATE = ('{{- if .System }}<|im_start|>system\n{{ .System }}<|im_end|>\n{{ end }}'
               '<|im_start|>user\n{{ .Prompt }}<|im_end|>\n<|im_start|>assistant\n')
JINJA_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                  "<|im_end|>\n{% endfor %}<|im_start|>assistant\n")


@pytest.fixture(scope="module")
def local(store):
    return LocalClient(store)


def create(local, name: str, text: str, base_dir=None) -> list[dict]:
    req = {"model": name, "modelfile": text}
    if base_dir is not None:
        req["base_dir"] = str(base_dir)
    return list(local.create(req))


def refusal(local, text: str, base_dir=None) -> ModelfileError:
    with pytest.raises(ModelfileError) as error:
        create(local, "refused", text, base_dir)
    assert not local.store.exists("refused")
    return error.value


def test_a_go_template_is_refused_at_create_with_its_line(local):
    error = refusal(local, f'FROM tiny\nPARAMETER temperature 0\nTEMPLATE """{GO_TEMPLATE}"""\n')
    assert error.line == 3 and "Go" in str(error) and "Jinja2" in str(error)
    error = refusal(local, 'FROM tiny\nTEMPLATE "{% for m in messages %}"\n')
    assert error.line == 2 and "TEMPLATE" in str(error)
    assert create(local, "jinja", f'FROM tiny\nTEMPLATE """{JINJA_TEMPLATE}"""\n')[-1] == \
        {"status": "success"}


def test_go_template_detection_has_no_false_alarms_on_jinja():
    assert looks_like_go_template(GO_TEMPLATE)
    assert looks_like_go_template("{{ range .Messages }}{{ .Content }}{{ end }}")
    assert not looks_like_go_template(JINJA_TEMPLATE)
    assert not looks_like_go_template("{{- bos_token }}{%- if tools %}{{ tools | tojson }}{% endif %}")


def test_an_unknown_draft_is_refused_a_drafter_or_stored_model_is_not(local):
    error = refusal(local, "FROM tiny\nDRAFT nosuchdraft\n")
    assert error.line == 2 and "nosuchdraft" in str(error) and "ngram" in str(error)
    assert refusal(local, "FROM tiny\nDRAFT /no/such/folder\n").line == 2
    for draft in ("ngram", "tiny"):
        assert create(local, f"drafted-{draft}", f"FROM tiny\nDRAFT {draft}\n")[-1] == \
            {"status": "success"}


def test_a_draft_with_another_vocabulary_is_refused(local, tmp_path):
    other = write_tiny_chat_model(tmp_path / "other", vocab_size=512)
    error = refusal(local, f"FROM tiny\nDRAFT {other}\n")
    assert "vocabulary" in str(error) and "512" in str(error)


def test_an_unsupported_architecture_is_refused_at_create(local, tmp_path):
    folder = write_tiny_chat_model(tmp_path / "odd")
    config = json.loads((folder / "config.json").read_text())
    config["architectures"] = ["MambaForCausalLM"]
    (folder / "config.json").write_text(json.dumps(config))
    error = refusal(local, "FROM ./odd\n", base_dir=tmp_path)
    assert error.line == 1 and "MambaForCausalLM" in str(error)


def test_a_missing_adapter_is_refused(local):
    error = refusal(local, "FROM tiny\nPARAMETER temperature 0\nADAPTER ./no-such-lora\n")
    assert error.line == 3 and "ADAPTER ./no-such-lora: no such folder" in str(error)
