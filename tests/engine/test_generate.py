import threading
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from exl3cli.engine.generation.generator import Generator
from exl3cli.engine.generation.jobs import GenerationJob
from exl3cli.engine.generation.text_events import StopStringMatcher
from exl3cli.engine.generation.textmodel import TextModel
from exl3cli.engine.text.tokenizer import Tokenizer
from exl3cli.errors import ContextOverflow
from tests.fixtures.tiny_tokenizer import write_tiny_tokenizer


class ScriptedModel(nn.Module):
    """Test double for CausalLM in the generator: for a sequence whose last new token
    sits at position p the logits point at script[p + 1], so greedy decoding replays the
    script. Counts forward calls (steps)."""

    def __init__(self, script, vocab_size):
        super().__init__()
        self.script = list(script)
        self.vocab_size = vocab_size
        self.config = SimpleNamespace(max_position_embeddings=4096, num_kv_heads=1, head_dim=32,
                                      vocab_size=vocab_size)
        self.layers = []
        self.dtype, self.device = torch.float32, torch.device("cpu")
        self.calls = 0

    def forward(self, input_ids, batch, last_logits_only=True):
        assert last_logits_only and input_ids.shape == (1, batch.total)
        rows = []
        for start, count in zip(batch.starts, batch.counts, strict=True):
            target = self.script[min(start + count, len(self.script) - 1)]
            row = torch.zeros(self.vocab_size)
            row[target] = 10.0
            rows.append(row)
        batch.advance()
        self.calls += 1
        return torch.stack(rows)[None]


def _stream(tok, model, prompt_ids, max_seq_len=256, **kwargs):
    """TextModel.stream over the scripted model (the generator, one job)."""
    text_model = TextModel(model, tok, chat_template=None)
    options = {"temperature": 0, "num_ctx": max_seq_len}
    return text_model.stream(prompt_ids, options, **kwargs)


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    folder = write_tiny_tokenizer(tmp_path_factory.mktemp("tok"), eos_token="<|endoftext|>")
    return Tokenizer.from_folder(folder)




def _run(tok, prompt, answer_ids, max_seq_len=256, **kwargs):
    prompt_ids = tok.encode(prompt)
    model = ScriptedModel(prompt_ids + answer_ids, tok.vocab_size)
    events = list(_stream(tok, model, prompt_ids, max_seq_len, **kwargs))
    assert events[-1].done and all(not e.done for e in events[:-1])
    text = "".join(e.text for e in events[:-1])
    return text, events, model


def _eos(tok):
    return tok.token_to_id("<|endoftext|>")


def test_stops_on_eos(tok):
    answer = tok.encode(" Paris is the capital.")
    text, events, _ = _run(tok, "Question:", answer + [_eos(tok)] + tok.encode(" junk"))
    assert text == " Paris is the capital."
    done = events[-1]
    assert done.done_reason == "stop"
    assert done.eval_count == len(answer) + 1  # the EOS was sampled too
    assert done.prompt_eval_count == len(tok.encode("Question:"))
    for name in ("prompt_eval_duration", "eval_duration"):
        assert isinstance(getattr(done, name), int) and getattr(done, name) > 0
    # token_ids of the text events are exactly the answer tokens.
    assert [t for e in events[:-1] for t in e.token_ids] == answer


def test_num_predict_limits_tokens(tok):
    answer = tok.encode(" one two three four five six")
    text, events, _ = _run(tok, "Count:", answer, num_predict=3)
    assert text == tok.decode(answer[:3])
    assert events[-1].done_reason == "length" and events[-1].eval_count == 3


def test_num_predict_zero_generates_nothing(tok):
    text, events, _ = _run(tok, "Count:", tok.encode(" one"), num_predict=0)
    assert text == "" and events[-1].done_reason == "length" and events[-1].eval_count == 0


def test_context_limit_ends_with_length(tok):
    prompt_ids = tok.encode("Count:")
    answer = tok.encode(" one two three four five six")
    text, events, _ = _run(tok, "Count:", answer, max_seq_len=len(prompt_ids) + 2)
    assert text == tok.decode(answer[:2])
    assert events[-1].done_reason == "length"


def test_prompt_longer_than_context_raises(tok):
    prompt_ids = tok.encode("a prompt that is long enough")
    model = ScriptedModel(prompt_ids, tok.vocab_size)
    with pytest.raises(ContextOverflow):
        list(_stream(tok, model, prompt_ids, max_seq_len=len(prompt_ids)))


def test_long_prompt_is_prefilled_in_chunks(tok):
    prompt_ids = tok.encode("The quick brown fox jumps over the lazy dog.")
    answer = tok.encode(" Hello") + [_eos(tok)]
    model = ScriptedModel(prompt_ids + answer, tok.vocab_size)
    generator = Generator(model, tok, max_batch=1, num_ctx=256, max_prefill_tokens=4)
    handle = generator.submit(GenerationJob(prompt_ids, {"temperature": 0}))
    assert handle.text() == " Hello"
    prefill_calls = -(-len(prompt_ids) // 4)
    assert model.calls == prefill_calls + len(answer) - 1


def test_stop_string_is_cut_and_never_partly_shown(tok):
    answer = tok.encode(" Hello world! User: more text")
    text, events, _ = _run(tok, "Hi", answer, stop=["User:"])
    assert text == " Hello world! "
    assert events[-1].done_reason == "stop"
    assert all("U" not in e.text for e in events)


def test_unfinished_stop_prefix_is_released_at_the_end(tok):
    answer = tok.encode(" Hello Use") + [_eos(tok)]
    text, _, _ = _run(tok, "Hi", answer, stop=["User:"])
    assert text == " Hello Use"


def test_special_token_stop_string(tok):
    # <|im_end|> is not an EOS id for this tokenizer and decodes to "" (special).
    im_end = tok.token_to_id("<|im_end|>")
    assert im_end not in tok.eos_token_ids
    answer = tok.encode(" Sure.") + [im_end] + tok.encode(" leaked")
    text, events, _ = _run(tok, "Hi", answer, stop=["<|im_end|>"])
    assert text == " Sure." and events[-1].done_reason == "stop"


def test_multibyte_text_streams_whole_characters(tok):
    answer = tok.encode(" 东京 😀 café") + [_eos(tok)]
    text, events, _ = _run(tok, "Say:", answer)
    assert text == " 东京 😀 café"
    assert all("\ufffd" not in e.text for e in events)


def test_cancel_stops_generation(tok):
    cancel = threading.Event()
    prompt_ids = tok.encode("Count:")
    answer = tok.encode(" one two three four five six seven eight nine ten")
    model = ScriptedModel(prompt_ids + answer, tok.vocab_size)
    events = []
    for event in _stream(tok, model, prompt_ids, cancel=cancel):
        events.append(event)
        cancel.set()  # the consumer gives up after the first delta
    assert len(events) == 2 and events[-1].done and events[-1].cancelled
    assert events[-1].done_reason == "stop"
    assert events[-1].eval_count < len(answer)


def test_cancel_before_start_generates_nothing(tok):
    cancel = threading.Event()
    cancel.set()
    text, events, model = _run(tok, "Count:", tok.encode(" one"), cancel=cancel)
    assert text == "" and events[-1].eval_count == 0 and model.calls == 0


def test_stop_string_matcher_across_pushes():
    matcher = StopStringMatcher(["</s>", "###"])
    shown = []
    for piece in ["Hello <", "/", "x> and #", "#", "# tail"]:
        text, stopped = matcher.push(piece)
        shown.append(text)
        if stopped:
            break
    assert shown == ["Hello ", "", "</x> and ", "", ""]
    assert stopped and matcher.flush() == ""


def test_stop_string_matcher_earliest_stop_wins_and_flush():
    matcher = StopStringMatcher(["bc", "abcd"])
    assert matcher.push("xabcd") == ("x", True)  # "abcd" starts before "bc"
    held = StopStringMatcher(["STOP"])
    assert held.push("go ST") == ("go ", False)
    assert held.flush() == "ST"
    assert StopStringMatcher([]).push("anything") == ("anything", False)


def test_end_to_end_on_a_tiny_real_model(tmp_path):
    """TextModel on a real checkpoint folder (written by transformers) + real tokenizer,
    checked against greedy decoding with the transformers model itself."""
    from exl3cli.engine.generation.textmodel import TextModel
    from tests.fixtures.tiny_model import tiny_reference_model, write_tiny_model

    vocab = Tokenizer.from_folder(write_tiny_tokenizer(tmp_path / "probe")).vocab_size
    folder = write_tiny_model(tmp_path / "model", "qwen2", vocab_size=vocab)
    write_tiny_tokenizer(folder)
    text_model = TextModel.load(folder, device="cpu")
    prompt_ids = text_model.chat_prompt([{"role": "user", "content": "Hello there"}])
    assert text_model.tokenizer.decode(prompt_ids, skip_special_tokens=False).endswith(
        "<|im_start|>user\nHello there<|im_end|>\n<|im_start|>assistant\n"
    )

    events = list(text_model.stream(prompt_ids, {"temperature": 0}, num_predict=12))
    ours = [t for e in events[:-1] for t in e.token_ids]
    done = events[-1]

    reference = tiny_reference_model("qwen2", vocab_size=vocab)
    expected, ids = [], list(prompt_ids)
    with torch.no_grad():
        for _ in range(12):
            token = int(reference(torch.tensor([ids])).logits[0, -1].argmax())
            if token in text_model.tokenizer.eos_token_ids:
                break
            expected.append(token)
            ids.append(token)
    assert len(expected) >= 3  # a meaningful stretch of text, not an instant EOS
    assert ours == expected
    assert "".join(e.text for e in events[:-1]) == text_model.tokenizer.decode(expected)
    assert done.prompt_eval_count == len(prompt_ids)
    assert done.done_reason == ("length" if len(expected) == 12 else "stop")
