import re
import textwrap
from pathlib import Path

import pytest

import exl3cli.api
from exl3cli.api import load
from exl3cli.errors import ContextOverflow, ModelNotFound
from tests.fixtures.paged import greedy_reference
from tests.fixtures.tiny_store import make_tiny_store, write_tiny_chat_model


def documented_snippet() -> str:
    """The indented example at the top of exl3cli/api.py (the README shows the same)."""
    lines = exl3cli.api.__doc__.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("    "))
    end = next(i for i in range(start, len(lines))
               if lines[i].strip() and not lines[i].startswith("    "))
    return textwrap.dedent("\n".join(lines[start:end])).strip() + "\n"


def readme_snippet() -> str:
    """The Python block of the README's "From Python" section."""
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    section = readme.split("### From Python", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_the_readme_shows_the_documented_snippet():
    assert readme_snippet() == documented_snippet()


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return write_tiny_chat_model(tmp_path_factory.mktemp("api") / "model",
                                 max_position_embeddings=1024)


def test_the_documented_snippet_runs(model_path, capsys):
    snippet = documented_snippet()
    assert snippet.startswith("from exl3cli.api import load")
    namespace = {"model_path": str(model_path)}
    exec(snippet, namespace)  # exactly the documented code
    llm = namespace["llm"]
    assert llm.generator.cache_type.name == "q8"
    assert isinstance(namespace["reply"], str)
    assert [type(a) for a in namespace["answers"]] == [str, str, str]
    printed = capsys.readouterr().out
    assert printed  # the two generate calls printed their text
    assert llm.generator.pool.pages_in_use == 0


def test_generate_returns_the_greedy_completion(model_path):
    llm = load(model_path, max_seq_len=512, max_batch=4)
    prompt = "The quick brown fox"
    text = llm.generate(prompt, max_tokens=10, temperature=0)
    ids = llm.tokenizer.encode(prompt)
    expected = greedy_reference(llm.model, ids, 10, llm.tokenizer.eos_token_ids)
    assert text == llm.tokenizer.decode(expected)
    streamed = llm.generate(prompt, max_tokens=10, temperature=0, stream=True)
    assert not isinstance(streamed, str)
    assert "".join(streamed) == text


def test_chat_uses_the_template_and_jobs_run_concurrently(model_path):
    llm = load(model_path, max_seq_len=512, max_batch=4)
    messages = [{"role": "user", "content": "Hello there"}]
    handle = llm.submit(messages, max_tokens=5, temperature=0)
    assert handle.prompt == llm.text_model.chat_prompt(messages)
    reply = "".join(e.text for e in handle)
    assert llm.chat(messages, max_tokens=5, temperature=0) == reply
    handles = [llm.submit(p, max_tokens=4, temperature=0) for p in ("One", "Two", "Three")]
    report = llm.generator.step()
    assert report.jobs == 3  # all three prompts went through one forward pass
    texts = [h.text() for h in handles]
    assert texts == [llm.generate(p, max_tokens=4, temperature=0) for p in ("One", "Two", "Three")]


def test_background_mode_and_errors(model_path):
    with load(model_path, max_seq_len=64, background=True) as llm:
        assert isinstance(llm.generate("Hello", max_tokens=3, temperature=0), str)
        with pytest.raises(ContextOverflow):
            llm.generate("word " * 200, max_tokens=3)


def test_load_by_store_name(tmp_path):
    store = make_tiny_store(tmp_path, name="tiny")
    llm = load("tiny", store_root=store.root, max_seq_len=128, kv_cache_type="q4")
    assert llm.generator.cache_type.name == "q4"
    assert isinstance(llm.generate("Hi", max_tokens=2), str)


def test_draft_keeps_the_greedy_text(model_path, monkeypatch):
    # The draft model is the model itself: its forward costs a plain step, which the
    # cost rule rightly refuses (tests/engine/test_draft_gate.py); here the drafting
    # path is under test, so drafting is judged on acceptance only.
    monkeypatch.setenv("EXL3_DRAFT_COST", "0")
    plain = load(model_path, max_seq_len=512)
    prompt = "one two three four one two three four one two"
    want = plain.generate(prompt, max_tokens=30, temperature=0)
    for draft in ("ngram", str(model_path)):  # prompt lookup, and a draft model
        llm = load(model_path, max_seq_len=512, draft=draft, draft_tokens=3)
        handle = llm.submit(prompt, max_tokens=30, temperature=0)
        assert handle.text() == want
        assert handle.final.draft_count > 0, draft
        # The job is over: a draft model's cache for it is gone, the handle lives on.
        assert getattr(handle.job.drafter, "table", None) is None
    with pytest.raises(ModelNotFound):
        load(model_path, draft="no-such-draft-model", store_root=model_path.parent / "s")


def test_adapters_per_request(model_path, tmp_path):
    from exl3cli.errors import AdapterError, InvalidOption
    from tests.engine.test_lora import make_adapter
    from tests.fixtures.tiny_model import tiny_reference_model

    reference = tiny_reference_model("llama", vocab_size=400, max_position_embeddings=1024)
    folder = make_adapter(reference, tmp_path / "mine", seed=1)
    llm = load(model_path, max_seq_len=512, max_batch=4, adapters={"mine": folder})
    assert llm.adapters == ["mine"]
    settings = {"max_tokens": 8, "temperature": 0}
    alone = [llm.generate("The sky is", adapter=name, **settings) for name in ("mine", None)]
    assert alone[0] != alone[1]
    handles = [llm.submit("The sky is", adapter=name, **settings) for name in ("mine", None)]
    assert [h.text() for h in handles] == alone
    with pytest.raises(InvalidOption, match="adapter 'other' is not loaded"):
        llm.submit("x", adapter="other")
    wide = make_adapter(tiny_reference_model("llama", hidden_size=96), tmp_path / "wide", seed=2)
    with pytest.raises(AdapterError, match="adapter wide: shape mismatch"):
        llm.load_adapter(wide)
    busy = llm.submit("The sky is", adapter="mine", max_tokens=4)
    with pytest.raises(InvalidOption, match="in use"):
        llm.unload_adapter("mine")
    busy.text()
    assert llm.unload_adapter("mine") and llm.adapters == []
    assert llm.generate("The sky is", **settings) == alone[1]
