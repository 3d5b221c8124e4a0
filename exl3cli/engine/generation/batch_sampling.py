"""Sampling every row of a generator step at once, on the logits' device.

`sample_rows(logits, samplers, histories)` returns one token per row. Rows whose
sampler is the built-in pipeline with only the common steps active (greedy, or
temperature with top_k / top_p / min_p) are sampled together with tensor ops and read
back with one copy for the whole batch; any other row (penalties, typical_p, a seed,
a plugin's step) runs its own `Sampler.sample`, the reference every batched row
must agree with (same distribution: tests/engine/test_batch_sampling.py).
`sample_and_pick` adds the argmax of a verifying greedy job's rows (speculative
decoding's check of its drafts) to the same read-back.

The batched pipeline applies the steps in the same order as the reference (top_k,
top_p, min_p, then temperature) to the row's `top_k` best candidates (the whole
vocabulary when a row has top_k off).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from exl3cli.engine.generation.sampling import Sampler

# Built-in steps the batched path reproduces, and those it may pass over when the
# request leaves them off.
_BUILTIN_MODULE = "exl3_plugins.samplers"
_BATCHED_STEPS = {"top_k", "top_p", "min_p", "temperature"}


def _penalties_off(options: dict) -> bool:
    return (options.get("repeat_last_n", 64) == 0
            or (options.get("repeat_penalty", 1.0) == 1.0
                and options.get("presence_penalty", 0.0) == 0.0
                and options.get("frequency_penalty", 0.0) == 0.0))


_OFF_WHEN = {
    "penalties": _penalties_off,
    "typical_p": lambda options: float(options.get("typical_p", 1.0)) >= 1.0,
    "dry": lambda options: float(options.get("dry_multiplier", 0.0)) == 0.0,
    "xtc": lambda options: float(options.get("xtc_probability", 0.0)) == 0.0,
}


def batchable(sampler: Sampler) -> bool:
    """Whether `sample_rows` may sample this row with the batched tensor pipeline: a
    plain Sampler (not a wrapper that watches its own calls), no seed, and every
    built-in step either reproduced here or off for this request."""
    if type(sampler) is not Sampler or sampler.seed is not None:
        return False
    greedy = sampler.greedy
    for step in sampler.steps:
        if type(step).__module__ != _BUILTIN_MODULE:
            return False
        if (greedy and step.skip_when_greedy) or step.name in _BATCHED_STEPS:
            continue
        off = _OFF_WHEN.get(step.name)
        if off is None or not off(sampler.options):
            return False
    return True


@dataclass
class _Params:
    temperature: torch.Tensor  # [n, 1]
    top_k: int  # candidates kept per row (the largest top_k; vocabulary when any is off)
    row_top_k: torch.Tensor  # [n, 1]
    top_p: torch.Tensor  # [n, 1]
    min_p: torch.Tensor  # [n, 1]


def _params(samplers: Sequence[Sampler], vocab: int, device: torch.device) -> _Params:
    temps, ks, ps, mins = [], [], [], []
    for sampler in samplers:
        options = sampler.options
        k = int(options.get("top_k", 0))
        ks.append(k if 0 < k < vocab else vocab)
        temps.append(float(options.get("temperature", 1.0)))
        ps.append(float(options.get("top_p", 1.0)))
        mins.append(float(options.get("min_p", 0.0)))
    table = torch.tensor([temps, ks, ps, mins], dtype=torch.float32).t().contiguous()
    table = table.to(device, non_blocking=True)
    return _Params(table[:, 0:1], max(ks), table[:, 1:2], table[:, 2:3], table[:, 3:4])


def batched_probs(logits: torch.Tensor, samplers: Sequence[Sampler]
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """The sampling distribution of each (non-greedy, batchable) row over its
    candidates: (probs [n, k], token ids [n, k]); masked candidates have probability 0."""
    logits = logits.float()
    params = _params(samplers, logits.shape[-1], logits.device)
    if params.top_k < logits.shape[-1]:
        values, ids = torch.topk(logits, params.top_k, dim=-1)
    else:
        values, ids = torch.sort(logits, dim=-1, descending=True, stable=True)
    ranks = torch.arange(values.shape[-1], device=logits.device)[None, :]
    # Masks by fill, not by a -inf tensor made from a Python float (a blocking copy to the
    # device: it would wait for the step launched ahead, ahead_step.py).
    values = values.masked_fill(ranks >= params.row_top_k, float("-inf"))
    # top_p: keep the smallest prefix whose mass reaches p (at least one token).
    probs = torch.softmax(values, dim=-1)
    mass_before = probs.cumsum(-1) - probs
    keep = (mass_before < params.top_p) | (ranks == 0) | (params.top_p >= 1.0)
    values = values.masked_fill(~keep, float("-inf"))
    # min_p: drop tokens below min_p times the most likely one.
    probs = torch.softmax(values, dim=-1)
    keep = (probs >= probs[:, :1] * params.min_p) | (params.min_p <= 0.0)
    values = values.masked_fill(~keep, float("-inf"))
    temperature = torch.where(params.temperature == 1.0, torch.ones_like(params.temperature),
                              params.temperature)
    return torch.softmax(values / temperature, dim=-1), ids


_CHUNKS = (256, 128, 512, 64, 1024, 32, 16, 8)


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """torch.argmax(logits, -1) for logits [n, V] (the first of equal maxima), in two
    passes where a chunk width divides V: each chunk's max, then the first chunk holding
    the row's max. A 128k-wide row is reduced by few blocks in one torch.argmax; here
    the first pass spreads it over V / chunk outputs (a decode step's greedy token)."""
    rows, vocab = logits.shape
    chunk = next((c for c in _CHUNKS if vocab % c == 0 and vocab >= 2 * c), 0)
    if not chunk:
        return torch.argmax(logits, dim=-1)
    values, within = logits.reshape(rows, vocab // chunk, chunk).max(dim=-1)
    best = values.argmax(dim=-1)
    return best * chunk + within.gather(1, best[:, None])[:, 0]


def sample_on_device(logits: torch.Tensor, samplers: Sequence[Sampler],
                     checked: bool = False, greedy: torch.Tensor | None = None
                     ) -> torch.Tensor | None:
    """Every row's token as a device tensor [n] (nothing read back), or None when a row
    needs its own sampler. `checked`: the caller knows every sampler is `batchable`;
    `greedy`: each row's argmax, already computed (decode_step.DecodeRunner.greedy)."""
    if not checked and not all(batchable(s) for s in samplers):
        return None
    drawn = [i for i, sampler in enumerate(samplers) if not sampler.greedy]
    if greedy is None:
        tokens = torch.argmax(logits, dim=-1)
    else:  # a graph's output: written over by its next replay, so drawn rows get a copy
        tokens = greedy.clone() if drawn else greedy
    if len(drawn) == len(samplers):  # every row drawn: no row index to send
        probs, ids = batched_probs(logits, samplers)
        return ids.gather(1, draw_rows(probs)[:, None])[:, 0]
    if drawn:
        index = to_device(drawn, logits.device)
        probs, ids = batched_probs(logits.index_select(0, index), [samplers[i] for i in drawn])
        tokens.index_copy_(0, index, ids.gather(1, draw_rows(probs)[:, None])[:, 0])
    return tokens


def draw_rows(probs: torch.Tensor) -> torch.Tensor:
    """One index per row of probs [n, k], drawn as torch.multinomial(probs, 1) draws it,
    from the same random numbers to the same result (its one-sample method: the argmax
    of p / q, q ~ Exp(1)), without its checks of the probabilities, which read values
    back to the host: a sync that would wait for the step launched ahead (ahead_step.py).
    The probabilities here come from a softmax (finite, >= 0, sum 1)."""
    q = torch.empty_like(probs).exponential_(1)
    return (probs / q).argmax(dim=-1)


def to_device(values: list[int], device: torch.device) -> torch.Tensor:
    """A long tensor of `values` on `device` without waiting for the device's queued work
    (torch.tensor(..., device=) copies with a stream sync; this copy is asynchronous)."""
    return torch.tensor(values, dtype=torch.long).to(device, non_blocking=True)


def sample_rows(logits: torch.Tensor, samplers: Sequence[Sampler],
                histories: Sequence[list[int]]) -> list[int]:
    """One token per row of logits [n, V]: batched where `batchable`, else each row's
    own sampler."""
    together = sample_on_device(logits, samplers)
    if together is not None:
        return together.tolist()  # the step's one read-back
    count = logits.shape[0]
    tokens: list[int | None] = [None] * count
    batched = [i for i in range(count) if batchable(samplers[i])]
    if batched:
        index = torch.tensor(batched, device=logits.device)
        some = sample_on_device(logits.index_select(0, index), [samplers[i] for i in batched])
        for i, token in zip(batched, some.tolist(), strict=True):
            tokens[i] = int(token)
    for i in range(count):
        if tokens[i] is None:
            tokens[i] = samplers[i].sample(logits[i], histories[i])
    return tokens  # type: ignore[return-value]


def sample_and_pick(logits: torch.Tensor, rows: Sequence[int], samplers: Sequence[Sampler],
                    histories: Sequence[list[int]], pick_rows: Sequence[Sequence[int]]
                    ) -> tuple[list[int], list[list[int]]]:
    """`sample_rows` of logits[rows], and the argmax of every row of each `pick_rows`
    group (a verifying job with a batchable greedy sampler: its choice after the pending
    token and each draft, what `speculative.verify` would pick), read back together: one
    copy for the whole step when every sampled row batches."""
    device = logits.device
    drawn: list[int] = []
    on_device: torch.Tensor | None = None
    if rows:
        some = logits.index_select(0, torch.tensor(list(rows), device=device))
        on_device = sample_on_device(some, samplers)
        if on_device is None:
            drawn = sample_rows(some, samplers, histories)
    parts = [] if on_device is None else [on_device]
    if any(pick_rows):
        parts.append(_picks(logits, pick_rows))
    values = torch.cat(parts).tolist() if parts else []  # the step's one read-back
    if on_device is not None:
        drawn, values = values[: len(rows)], values[len(rows):]
    return drawn, split_picks(values, pick_rows)


def _picks(logits: torch.Tensor, pick_rows: Sequence[Sequence[int]]) -> torch.Tensor:
    """The argmax of every row (a pass has at most 64), then the rows wanted, in order."""
    flat = [row for group in pick_rows for row in group]
    return torch.argmax(logits, dim=-1).index_select(0, to_device(flat, logits.device))


def split_picks(values: Sequence[int], pick_rows: Sequence[Sequence[int]]) -> list[list[int]]:
    """The flat picks read back, one list per `pick_rows` group."""
    picks, first = [], 0
    for group in pick_rows:
        picks.append(list(values[first : first + len(group)]))
        first += len(group)
    return picks


def launch_sample_and_pick(logits: torch.Tensor, rows: Sequence[int],
                           samplers: Sequence[Sampler], pick_rows: Sequence[Sequence[int]]
                           ) -> torch.Tensor:
    """`sample_and_pick` left on the device for samplers that all batch (the caller
    checked): [the tokens of `rows`..., the flat picks...], nothing read back (a
    verification pass launched ahead, verify_ahead.py)."""
    parts = []
    if rows:
        some = logits.index_select(0, to_device(list(rows), logits.device))
        parts.append(sample_on_device(some, samplers, checked=True))
    if any(pick_rows):
        parts.append(_picks(logits, pick_rows))
    return torch.cat(parts)
