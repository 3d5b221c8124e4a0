"""Token ids from outside are checked before they reach a shared batch."""

from __future__ import annotations

import pytest

from exl3cli.engine.generation.generator import Generator
from exl3cli.engine.generation.jobs import GenerationJob
from exl3cli.engine.generation.sampling import build_sampler
from exl3cli.engine.text.token_ids import check_token_ids
from exl3cli.errors import InvalidOption


def test_check_token_ids_names_the_first_bad_id():
    assert check_token_ids([0, 5, 399], 400) == [0, 5, 399]
    for bad, where in (([1, 400], "1 is 400"), ([-1], "0 is -1"), ([3, 1_000_000], "1 is 1000000")):
        with pytest.raises(InvalidOption, match=where):
            check_token_ids(bad, 400)
    with pytest.raises(InvalidOption, match="not an integer"):
        check_token_ids([1.5], 400)
    with pytest.raises(InvalidOption, match="not an integer"):
        check_token_ids([True], 400)


def test_a_job_with_ids_past_the_vocabulary_is_refused_and_others_finish(text_model):
    generator = Generator(text_model.model, text_model.tokenizer, max_batch=4, num_ctx=256)
    sampler = build_sampler({"temperature": 0})
    innocent = [generator.submit(GenerationJob([5, 6, 7, 8], sampler=sampler, num_predict=8))
                for _ in range(2)]
    with pytest.raises(InvalidOption, match="outside the model's vocabulary"):
        generator.submit(GenerationJob([5, 399, 400, 1_000_000], sampler=sampler, num_predict=8))
    generator.run_until_done()
    for handle in innocent:
        assert handle.final is not None and handle.final.eval_count == 8
