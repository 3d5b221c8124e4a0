"""A Modelfile DRAFT turns on speculative decoding: same greedy text, drafts counted."""

from __future__ import annotations

import pytest

from exl3cli.cli.output import format_stats
from exl3cli.errors import InvalidOption
from exl3cli.runtime.residency import InferenceRunner
from exl3cli.store.manifest import Manifest

GREEDY = {"temperature": 0}
# A prompt that repeats itself, so prompt lookup has something to draft.
PROMPT = "one two three four five one two three four five one two three four five one two"


@pytest.fixture(scope="module")
def runner(store):
    # Drafting backs off on acceptance only here: the self-drafted model costs k + 1
    # passes per pass on the CPU, which the cost back-off would (rightly) pause.
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("EXL3_DRAFT_COST", "0")
        yield _make_runner(store)


def _make_runner(store):
    base = store.read_manifest("tiny")
    drafts = (("tiny-ngram", "ngram"), ("tiny-missing-draft", "no-such-model:1b"),
              ("tiny-self-drafted", "tiny"))
    for name, draft in drafts:
        store.write_manifest(name, Manifest(files=dict(base.files), source=dict(base.source),
                                            draft=draft))
    return InferenceRunner(store)


def _final_and_text(runner, model: str, **options):
    chunks = list(runner.generate({"model": model, "prompt": PROMPT, "stream": False,
                                   "options": {**GREEDY, "num_predict": 40, **options}}))
    (final,) = chunks
    return final, final["response"]


def test_draft_ngram_gives_the_same_greedy_text_and_reports_its_drafts(runner):
    plain, plain_text = _final_and_text(runner, "tiny")
    drafted, drafted_text = _final_and_text(runner, "tiny-ngram")
    assert drafted_text == plain_text and drafted["eval_count"] == plain["eval_count"]
    assert "draft_count" not in plain
    assert drafted["draft_count"] > 0 and 0 <= drafted["draft_accepted"] <= drafted["draft_count"]
    assert "draft acceptance:" in format_stats(drafted)
    assert "draft acceptance" not in format_stats(plain)


def test_draft_num_predict_zero_turns_it_off_and_bad_values_are_refused(runner):
    final, _ = _final_and_text(runner, "tiny-ngram", draft_num_predict=0)
    assert "draft_count" not in final
    with pytest.raises(InvalidOption):
        _final_and_text(runner, "tiny-ngram", draft_num_predict=100)


def test_a_missing_draft_model_is_refused_by_name_unless_drafting_is_off(runner):
    # create refuses such a DRAFT; this is a draft removed from the store afterwards
    with pytest.raises(InvalidOption, match="DRAFT no-such-model:1b cannot be used"):
        _final_and_text(runner, "tiny-missing-draft")
    final, text = _final_and_text(runner, "tiny-missing-draft", draft_num_predict=0)
    _, plain_text = _final_and_text(runner, "tiny")
    assert text == plain_text and "draft_count" not in final


def test_a_draft_model_drafts_and_the_text_stays_the_same(runner):
    # The model as its own draft: every greedy draft is what the model would say.
    plain, plain_text = _final_and_text(runner, "tiny", num_predict=60)
    drafted, text = _final_and_text(runner, "tiny-self-drafted", num_predict=60)
    assert text == plain_text and drafted["eval_count"] == plain["eval_count"]
    assert drafted["draft_count"] >= 20
    assert drafted["draft_accepted"] >= 0.9 * drafted["draft_count"]
