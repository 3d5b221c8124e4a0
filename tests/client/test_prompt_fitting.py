"""Fitting a long chat into the context: a bounded number of renders, cancellable, and
a text too long to fit is refused before it is tokenized."""

from __future__ import annotations

import threading

import pytest

from exl3cli.errors import ContextOverflow
from exl3cli.runtime.jobs import PromptTooLong, encode_prompt, fit_prompt


class CountingChat:
    """A chat job of `turns` turns of `size` tokens each (plus a 3-token prompt)."""

    def __init__(self, turns: int, size: int = 5):
        self.turns, self.size, self.renders = turns, size, []
        self.max_tokens = None

    def droppable(self, manifest):
        return self.turns - 1

    def prompt_ids(self, text_model, manifest, drop=0):
        self.renders.append(drop)
        return [1] * ((self.turns - drop) * self.size + 3)


@pytest.mark.parametrize("turns, num_ctx", [(2000, 256), (100_000, 4096), (10, 1000), (50, 100)])
def test_the_fewest_turns_are_dropped_in_logarithmic_renders(turns, num_ctx):
    job = CountingChat(turns)
    ids = fit_prompt(job, None, {}, num_ctx)
    kept = (len(ids) - 3) // job.size
    assert len(ids) < num_ctx
    if kept < turns:  # one more turn would not have fit
        assert (kept + 1) * job.size + 3 >= num_ctx
    assert len(job.renders) <= 3 + turns.bit_length()  # was one render per dropped turn


def test_nothing_fits_returns_the_shortest_prompt_for_the_caller_to_refuse():
    job = CountingChat(3, size=100)
    assert len(fit_prompt(job, None, {}, 50)) == 103
    assert len(job.renders) == 2


def test_a_cancelled_request_stops_between_renders():
    cancel = threading.Event()
    cancel.set()
    job = CountingChat(1000)
    with pytest.raises(ContextOverflow, match="cancelled"):
        fit_prompt(job, None, {}, 64, cancel)
    assert job.renders == []


class FakeTokenizer:
    def __init__(self):
        self.encoded = 0

        class Backend:
            def get_vocab(self, with_added_tokens=True):
                return {"a": 0, "abcd": 1, "<|im_start|>": 2}

        self.backend = Backend()

    def encode(self, text):
        self.encoded += 1
        return [0] * len(text)


def test_a_text_too_long_for_the_context_is_not_tokenized():
    tokenizer = FakeTokenizer()
    with pytest.raises(PromptTooLong, match="at least 416 tokens"):
        encode_prompt(tokenizer, "x" * 10_000, 256)  # 10,000 / (2 * 12 chars) tokens at least
    assert tokenizer.encoded == 0
    assert len(encode_prompt(tokenizer, "x" * 100, 256)) == 100
    assert len(encode_prompt(tokenizer, "x" * 10_000, None)) == 10_000
