import math
from collections import Counter

import pytest
import torch

from exl3cli.engine.generation.sampling import SamplerContext, build_sampler, collect_steps
from exl3cli.errors import InvalidOption

PROBS = [0.5, 0.3, 0.15, 0.05]
NEUTRAL = {
    "temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "typical_p": 1.0,
    "repeat_penalty": 1.0, "repeat_last_n": 64, "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
}


def _logits(probs=PROBS):
    return torch.log(torch.tensor(probs, dtype=torch.float32))


def _step(name):
    return next(step for step in collect_steps() if step.name == name)


def _apply(name, logits, history=(), **options):
    ctx = SamplerContext({**NEUTRAL, **options}, list(history))
    return _step(name).apply(logits.clone(), ctx)


def _kept(logits):
    return [i for i, value in enumerate(logits.tolist()) if value != float("-inf")]


def test_builtin_steps_and_order():
    names = [step.name for step in collect_steps()]
    assert names == ["penalties", "dry", "top_k", "typical_p", "top_p", "min_p", "xtc",
                     "temperature"]


def test_defaults_follow_the_interface_spec():
    options = build_sampler({}).options
    assert options["temperature"] == 0.8
    assert options["top_k"] == 40
    assert options["top_p"] == 0.9
    assert options["min_p"] == 0.0
    assert options["typical_p"] == 1.0
    assert options["repeat_penalty"] == 1.0
    assert options["repeat_last_n"] == 64


def test_top_k():
    assert _kept(_apply("top_k", _logits(), top_k=2)) == [0, 1]
    assert _kept(_apply("top_k", _logits(), top_k=0)) == [0, 1, 2, 3]


def test_top_p():
    # Cumulative mass 0.5, 0.8, 0.95: three tokens are needed to reach 0.9.
    assert _kept(_apply("top_p", _logits(), top_p=0.9)) == [0, 1, 2]
    # 0.5 is reached by the first token alone.
    assert _kept(_apply("top_p", _logits(), top_p=0.5)) == [0]
    assert _kept(_apply("top_p", _logits(), top_p=0.0)) == [0]  # never empty
    kept = _apply("top_p", _logits(), top_p=0.9)
    assert torch.allclose(kept[:3], _logits()[:3])  # survivors are untouched


def test_min_p():
    # Threshold 0.2 * 0.5 = 0.1 drops only the 0.05 token; 0.7 * 0.5 = 0.35 keeps one.
    assert _kept(_apply("min_p", _logits(), min_p=0.2)) == [0, 1, 2]
    assert _kept(_apply("min_p", _logits(), min_p=0.7)) == [0]


def test_typical_p():
    entropy = -sum(p * math.log(p) for p in PROBS)
    distance = [abs(-math.log(p) - entropy) for p in PROBS]
    # By hand: entropy 1.142; surprisals 0.69, 1.20, 1.90, 3.00 -> token 1 is the most
    # typical, then token 0, then 2, then 3.
    assert sorted(range(4), key=distance.__getitem__) == [1, 0, 2, 3]
    # Mass in that order: 0.3, 0.8, ... -> p=0.5 keeps {1, 0}; p=0.25 keeps only {1}.
    assert _kept(_apply("typical_p", _logits(), typical_p=0.5)) == [0, 1]
    assert _kept(_apply("typical_p", _logits(), typical_p=0.25)) == [1]


def test_temperature():
    scaled = _apply("temperature", _logits(), temperature=0.5)
    squared = [p * p for p in PROBS]
    expected = [s / sum(squared) for s in squared]  # p^(1/T) renormalised
    assert torch.allclose(torch.softmax(scaled, -1), torch.tensor(expected), atol=1e-6)


def test_repeat_penalty_divides_positive_and_multiplies_negative_logits():
    logits = torch.tensor([2.0, -1.0, 0.5, 0.0])
    out = _apply("penalties", logits, history=[0, 1, 1], repeat_penalty=2.0)
    assert out.tolist() == [1.0, -2.0, 0.5, 0.0]


def test_frequency_and_presence_penalties():
    logits = torch.tensor([2.0, -1.0, 0.5, 0.0])
    out = _apply("penalties", logits, history=[0, 1, 1], frequency_penalty=0.5)
    assert out.tolist() == [1.5, -2.0, 0.5, 0.0]  # minus 0.5 per occurrence
    out = _apply("penalties", logits, history=[0, 1, 1], presence_penalty=0.25)
    assert out.tolist() == [1.75, -1.25, 0.5, 0.0]  # minus 0.25 once per seen token


def test_repeat_last_n_window():
    logits = torch.tensor([2.0, 2.0, 2.0, 2.0])
    history = [0, 1, 2]
    last_one = _apply("penalties", logits, history, repeat_penalty=2.0, repeat_last_n=1)
    assert last_one.tolist() == [2.0, 2.0, 1.0, 2.0]
    off = _apply("penalties", logits, history, repeat_penalty=2.0, repeat_last_n=0)
    assert off.tolist() == [2.0, 2.0, 2.0, 2.0]
    everything = _apply("penalties", logits, history, repeat_penalty=2.0, repeat_last_n=-1)
    assert everything.tolist() == [1.0, 1.0, 1.0, 2.0]


def test_temperature_zero_is_argmax_of_penalised_logits():
    # typical_p=0.25 alone would remove token 0; greedy must still pick it.
    sampler = build_sampler({"temperature": 0, "typical_p": 0.25, "seed": 1})
    assert sampler.greedy
    assert {sampler.sample(_logits(), []) for _ in range(10)} == {0}
    # Penalties still apply under greedy: token 0 seen twice drops below token 1.
    penalised = build_sampler({"temperature": 0, "frequency_penalty": 1.0})
    assert penalised.sample(_logits(), [0, 0]) == 1


def test_sampling_follows_the_truncated_distribution():
    sampler = build_sampler({**NEUTRAL, "top_k": 2, "seed": 1234})
    draws = Counter(sampler.sample(_logits(), []) for _ in range(3000))
    assert set(draws) == {0, 1}
    # After top_k=2 the distribution is 0.5/0.8 = 0.625 vs 0.375.
    assert abs(draws[0] / 3000 - 0.625) < 0.04


def test_same_seed_same_tokens_different_seed_different_tokens():
    flat = torch.zeros(50)

    def draw(seed):
        sampler = build_sampler({"seed": seed, "top_k": 0, "top_p": 1.0})
        return [sampler.sample(flat, []) for _ in range(30)]

    assert draw(7) == draw(7)
    assert draw(7) != draw(8)


def test_option_types_are_coerced():
    options = build_sampler({"temperature": "0.7", "top_k": 3.0, "top_p": 1}).options
    assert options["temperature"] == 0.7 and isinstance(options["temperature"], float)
    assert options["top_k"] == 3 and isinstance(options["top_k"], int)
    assert options["top_p"] == 1.0 and isinstance(options["top_p"], float)
    assert build_sampler({"temperature": None}).options["temperature"] == 0.8


@pytest.mark.parametrize(
    "options",
    [
        {"temperature": "hot"},
        {"top_k": 1.5},
        {"top_k": True},
        {"repeat_last_n": -5},
        {"top_p": float("nan")},
        {"seed": "abc"},
    ],
)
def test_bad_option_values_raise(options):
    with pytest.raises(InvalidOption):
        build_sampler(options)


def test_unknown_options_are_reported_not_fatal():
    sampler = build_sampler({"temperature": 0.1, "mirostat": 2, "num_ctx": 2048, "stop": ["x"]})
    assert sampler.unknown_options == ["mirostat"]


def _dry_reference(history, vocab, multiplier, base, allowed):
    """DRY penalties written out loop by loop (the definition)."""
    penalty = [0.0] * vocab
    size = len(history)
    for i in range(1, size):
        n = 0
        while n < i and history[i - 1 - n] == history[size - 1 - n]:
            n += 1
        if n >= allowed:
            penalty[history[i]] = max(penalty[history[i]], multiplier * base ** (n - allowed))
    return penalty


def test_dry_penalises_the_token_that_would_extend_a_repeat():
    logits = torch.zeros(6)
    history = [1, 2, 3, 4, 5, 1, 2, 3]  # "1 2 3" was followed by 4 before
    out = _apply("dry", logits, history, dry_multiplier=0.8, dry_base=1.75,
                 dry_allowed_length=2)
    assert out[4] == pytest.approx(-0.8 * 1.75 ** (3 - 2))
    assert [out[t].item() for t in (0, 1, 2, 3, 5)] == [0.0] * 5
    off = _apply("dry", logits, history, dry_multiplier=0.0, dry_base=1.75,
                 dry_allowed_length=2)
    assert torch.equal(off, logits)


@pytest.mark.parametrize("seed", range(5))
def test_dry_matches_the_definition_on_random_histories(seed):
    rng = torch.Generator().manual_seed(seed)
    history = torch.randint(0, 4, (60,), generator=rng).tolist()
    out = _apply("dry", torch.zeros(4), history, dry_multiplier=0.5, dry_base=1.5,
                 dry_allowed_length=2)
    expected = _dry_reference(history, 4, 0.5, 1.5, 2)
    assert (-out).tolist() == pytest.approx(expected)


def test_dry_changes_a_greedy_choice():
    history = [1, 2, 3, 1, 2]  # greedy would say 3 again
    logits = torch.tensor([0.0, 0.0, 0.0, 1.0, 0.5])
    sampler = build_sampler({"temperature": 0, "dry_multiplier": 2.0})
    assert build_sampler({"temperature": 0}).sample(logits, history) == 3
    assert sampler.sample(logits, history) == 4


def test_xtc_removes_the_top_choices_but_the_least_likely_of_them():
    logits = _logits([0.4, 0.3, 0.2, 0.1])
    out = _apply("xtc", logits, xtc_probability=1.0, xtc_threshold=0.15)
    assert _kept(out) == [2, 3]  # 0.4 and 0.3 go; 0.2 is the least likely top choice
    single = _apply("xtc", logits, xtc_probability=1.0, xtc_threshold=0.35)
    assert _kept(single) == [0, 1, 2, 3]  # one top choice: nothing to exclude
    never = _apply("xtc", logits, xtc_probability=0.0, xtc_threshold=0.15)
    assert _kept(never) == [0, 1, 2, 3]


def test_xtc_acts_at_about_its_probability_and_never_when_greedy():
    logits = _logits([0.4, 0.3, 0.2, 0.1])
    options = {**NEUTRAL, "xtc_probability": 0.5, "xtc_threshold": 0.15, "seed": 7}
    sampler = build_sampler(options)
    firsts = sum(sampler.sample(logits, []) in (0, 1) for _ in range(2000))
    # without XTC tokens 0/1 come 70% of the time; with it half the steps cannot pick them
    assert 0.30 < firsts / 2000 < 0.40
    greedy = build_sampler({**options, "temperature": 0})
    assert all(greedy.sample(logits, []) == 0 for _ in range(50))
