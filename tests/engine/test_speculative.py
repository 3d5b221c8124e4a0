"""Speculative decoding: the acceptance rule and the built-in ngram drafter."""

from __future__ import annotations

import random

import pytest
import torch

from exl3cli.engine.generation.sampling import build_sampler
from exl3cli.engine.generation.speculative import draft_count, make_drafter, verify
from exl3cli.errors import InvalidOption, ModelNotFound


def _logits_with_argmax(best: list[int], vocab: int = 10) -> torch.Tensor:
    rows = torch.randn(len(best), vocab, generator=torch.Generator().manual_seed(1))
    for row, token in enumerate(best):
        rows[row, token] = 10.0
    return rows


def test_greedy_keeps_drafts_while_they_are_the_argmax_then_corrects():
    sampler = build_sampler({"temperature": 0})
    logits = _logits_with_argmax([4, 7, 2, 9])
    assert verify(sampler, logits, [4, 7, 3], history=[1, 2]) == [4, 7, 2]
    assert verify(sampler, logits, [5, 7, 2], history=[1, 2]) == [4]
    # A fully accepted draft earns the bonus token from the last row.
    assert verify(sampler, logits, [4, 7, 2], history=[1, 2]) == [4, 7, 2, 9]
    assert verify(sampler, logits[:1], [], history=[1, 2]) == [4]


def test_greedy_verification_sees_the_accepted_drafts_in_its_history():
    # repeat_penalty depends on the history: the second row must be judged with the
    # first draft already in it, as plain decoding would.
    sampler = build_sampler({"temperature": 0, "repeat_penalty": 100.0, "repeat_last_n": 8})
    logits = torch.zeros(2, 6)
    logits[0, 3] = 5.0
    logits[1, 3], logits[1, 1] = 5.0, 4.0  # 3 wins unless it was just emitted
    assert verify(sampler, logits, [3], history=[0]) == [3, 1]


def test_sampled_tokens_keep_the_model_distribution():
    # Whatever the draft, the first emitted token must be distributed as p.
    p = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05])
    logits = torch.log(p).expand(2, 5).clone()
    sampler = build_sampler({"temperature": 1.0, "top_k": 0, "top_p": 1.0, "seed": 7})
    draws = 20000
    for draft_token in (0, 3):
        counts = torch.zeros(5)
        for _ in range(draws):
            counts[verify(sampler, logits, [draft_token], history=[])[0]] += 1
        total_variation = float((counts / draws - p).abs().sum() / 2)
        assert total_variation < 0.015, (draft_token, counts / draws)


def test_ngram_drafter_proposes_what_followed_the_latest_match():
    drafter = make_drafter("ngram")
    assert drafter.propose([1, 2, 3, 4, 5, 2, 3], 3) == [4, 5, 2]
    # The latest occurrence wins over an earlier one.
    assert drafter.propose([7, 8, 1, 7, 8, 2, 7, 8], 2) == [2, 7]
    # Longer matches are tried first: [5, 6] -> 9, although [6] alone -> 1 is later.
    assert drafter.propose([5, 6, 9, 0, 6, 1, 5, 6], 1) == [9]
    assert drafter.propose([1, 2, 3], 4) == []
    # Single-token matches are not used by default (too often wrong: a wasted pass).
    assert drafter.propose([4, 9, 4], 2) == []
    assert drafter.propose([1, 2, 1], 0) == []


def _scan(history: list[int], count: int, max_ngram: int = 3, min_ngram: int = 2) -> list[int]:
    """The lookup by a scan of the whole text (what the indexed drafter must equal)."""
    size = len(history)
    for n in range(min(max_ngram, size - 1), min_ngram - 1, -1):
        tail = history[size - n:]
        for start in range(size - n - 1, -1, -1):
            if history[start:start + n] == tail:
                return history[start + n:start + n + count]
    return []


def test_ngram_index_gives_the_scan_as_the_text_grows_and_when_it_changes():
    rng = random.Random(5)
    drafter = make_drafter("ngram")
    for _ in range(20):
        text = [rng.randrange(6) for _ in range(rng.randrange(1, 8))]
        for _ in range(60):  # one job's text growing a token (or a few) at a time
            count = rng.randrange(0, 5)
            assert drafter.propose(text, count) == _scan(text, count), (text, count)
            assert drafter.peek(text, count) == _scan(text, count)
            text = text + [rng.randrange(6) for _ in range(rng.randrange(1, 3))]
        text[rng.choice([0, -1])] = 7  # another text (its first or last token differs)
        assert drafter.propose(text, 3) == _scan(text, 3)
        text = text[: rng.randrange(1, len(text))]  # a shorter one
        assert drafter.propose(text, 3) == _scan(text, 3)
    wide = make_drafter("ngram:4")
    text = [rng.randrange(4) for _ in range(300)]
    assert wide.propose(text, 4) == _scan(text, 4, max_ngram=4)


def test_drafter_names_and_counts_are_checked():
    assert make_drafter("ngram:2").max_ngram == 2
    with pytest.raises(ModelNotFound):  # not a drafter's name: a draft model, missing here
        make_drafter("no-such-model-here")
    with pytest.raises(InvalidOption):
        make_drafter("ngram:0")
    assert draft_count({}) == 4 and draft_count({"draft_num_predict": 0}) == 0
    with pytest.raises(InvalidOption):
        draft_count({"draft_num_predict": 99})
