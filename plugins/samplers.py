"""Built-in sampler steps (registered through the exl3cli entry-point group).

Order follows llama.cpp's default chain, which Ollama used: penalties, DRY, top_k,
typical_p, top_p, min_p, XTC, temperature. Penalties use Ollama's semantics: within the
last `repeat_last_n` tokens (0 = off, -1 = all), a seen token's logit is divided by
`repeat_penalty` when positive (multiplied when negative), lowered by
`frequency_penalty` per occurrence and by `presence_penalty` once.

DRY ("don't repeat yourself") and XTC ("exclude top choices") are the ExLlama/
text-generation-webui samplers (`dry_*`, `xtc_*` parameters); both are off by default.
"""

from __future__ import annotations

import torch

from exl3cli.engine.generation.sampling import ParamSpec, SamplerContext, SamplerStep
from exl3cli.hookspecs import hookimpl

NEG_INF = float("-inf")


class PenaltiesStep(SamplerStep):
    name = "penalties"
    order = 10
    params = {
        "repeat_penalty": ParamSpec(float, 1.0, minimum=0.0, help="1.0 = off"),
        "repeat_last_n": ParamSpec(int, 64, minimum=-1, help="window; 0 = off, -1 = all"),
        "presence_penalty": ParamSpec(float, 0.0),
        "frequency_penalty": ParamSpec(float, 0.0),
    }

    def apply(self, logits: torch.Tensor, ctx: SamplerContext) -> torch.Tensor:
        opts = ctx.options
        repeat, presence, frequency = (
            opts["repeat_penalty"], opts["presence_penalty"], opts["frequency_penalty"]
        )
        window = opts["repeat_last_n"]
        if window == 0 or not ctx.history or (repeat == 1.0 and presence == 0 and frequency == 0):
            return logits
        recent = ctx.history if window < 0 else ctx.history[-window:]
        ids = torch.tensor(recent, dtype=torch.long, device=logits.device)
        ids = ids[(ids >= 0) & (ids < logits.numel())]
        tokens, counts = torch.unique(ids, return_counts=True)
        if tokens.numel() == 0:
            return logits
        seen = logits[tokens]
        if repeat != 1.0 and repeat > 0:
            seen = torch.where(seen > 0, seen / repeat, seen * repeat)
        seen = seen - counts.to(seen.dtype) * frequency - presence
        logits[tokens] = seen
        return logits


DRY_MAX_MATCH = 64  # longest repeated sequence DRY measures (the penalty is huge by then)
DRY_RANGE = 4096  # how far back DRY looks for earlier occurrences


def dry_match_lengths(history: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For every earlier position i of `history` (1 <= i < len), the token that came
    next there (`history[i]`) and how many tokens before it equal the end of the history
    (the length of the repeated sequence that token would extend)."""
    size = history.numel()
    ends = torch.arange(size - 1, device=history.device)  # i - 1
    lengths = torch.zeros(size - 1, dtype=torch.long, device=history.device)
    alive = torch.ones(size - 1, dtype=torch.bool, device=history.device)
    for back in range(min(DRY_MAX_MATCH, size - 1)):
        earlier = ends - back
        alive &= (earlier >= 0) & (history[earlier.clamp(min=0)] == history[size - 1 - back])
        if not bool(alive.any()):
            break
        lengths += alive
    return history[1:], lengths


class DryStep(SamplerStep):
    """Penalises a token that would extend a sequence already seen earlier: for a
    repeat of n >= dry_allowed_length tokens the logit drops by
    dry_multiplier * dry_base ** (n - dry_allowed_length). (No sequence breakers: every
    token counts.)"""

    name = "dry"
    order = 15
    params = {
        "dry_multiplier": ParamSpec(float, 0.0, minimum=0.0, help="DRY strength; 0 = off"),
        "dry_base": ParamSpec(float, 1.75, minimum=1.0, help="growth per repeated token"),
        "dry_allowed_length": ParamSpec(int, 2, minimum=1,
                                        help="longest repeat that goes unpenalised"),
    }

    def apply(self, logits: torch.Tensor, ctx: SamplerContext) -> torch.Tensor:
        opts = ctx.options
        multiplier, base = opts["dry_multiplier"], opts["dry_base"]
        allowed = opts["dry_allowed_length"]
        if multiplier <= 0 or len(ctx.history) < 2:
            return logits
        history = torch.tensor(ctx.history[-DRY_RANGE:], dtype=torch.long,
                               device=logits.device)
        tokens, lengths = dry_match_lengths(history)
        hit = (lengths >= allowed) & (tokens >= 0) & (tokens < logits.numel())
        if not bool(hit.any()):
            return logits
        exponent = (lengths[hit] - allowed).to(logits.dtype)
        amounts = multiplier * torch.pow(torch.full_like(exponent, base), exponent)
        penalty = torch.zeros_like(logits)
        penalty.scatter_reduce_(0, tokens[hit], amounts, reduce="amax")
        return logits - penalty


class XtcStep(SamplerStep):
    """With probability xtc_probability, removes every token at or above
    xtc_threshold probability except the least likely of them (only when two or more
    are): the most predictable choices give way to a still-likely one."""

    name = "xtc"
    order = 55
    params = {
        "xtc_probability": ParamSpec(float, 0.0, minimum=0.0, maximum=1.0,
                                     help="chance XTC acts at a step; 0 = off"),
        "xtc_threshold": ParamSpec(float, 0.1, minimum=0.0, maximum=1.0,
                                   help="probability that counts as a top choice"),
    }
    skip_when_greedy = True

    def apply(self, logits: torch.Tensor, ctx: SamplerContext) -> torch.Tensor:
        chance, threshold = ctx.options["xtc_probability"], ctx.options["xtc_threshold"]
        if chance <= 0:
            return logits
        draw = torch.rand((), generator=ctx.generator, device=logits.device)
        if float(draw) >= chance:
            return logits
        probs = torch.softmax(logits, dim=-1)
        top = probs >= threshold
        if int(top.sum()) < 2:
            return logits
        candidates = torch.nonzero(top).flatten()
        top[candidates[torch.argmin(probs[candidates])]] = False  # the least likely stays
        return logits.masked_fill(top, NEG_INF)


def _keep_sorted_prefix(logits: torch.Tensor, order: torch.Tensor, keep: int) -> torch.Tensor:
    """Keep the first `keep` tokens of `order` (at least one), mask the rest."""
    result = torch.full_like(logits, NEG_INF)
    kept = order[: max(1, keep)]
    result[kept] = logits[kept]
    return result


class TopKStep(SamplerStep):
    name = "top_k"
    order = 20
    params = {"top_k": ParamSpec(int, 40, help="keep the k most likely tokens; 0 = off")}
    skip_when_greedy = True

    def apply(self, logits: torch.Tensor, ctx: SamplerContext) -> torch.Tensor:
        k = ctx.options["top_k"]
        if k <= 0 or k >= logits.numel():
            return logits
        return _keep_sorted_prefix(logits, torch.topk(logits, k).indices, k)


class TypicalStep(SamplerStep):
    name = "typical_p"
    order = 30
    params = {"typical_p": ParamSpec(float, 1.0, help="locally typical sampling; 1 = off")}
    skip_when_greedy = True

    def apply(self, logits: torch.Tensor, ctx: SamplerContext) -> torch.Tensor:
        p = ctx.options["typical_p"]
        if p >= 1.0:
            return logits
        log_probs = torch.log_softmax(logits, dim=-1)
        probs = log_probs.exp()
        entropy = -(probs * torch.nan_to_num(log_probs, neginf=0.0)).sum()
        # Tokens whose surprisal is closest to the entropy come first.
        distance = (-log_probs - entropy).abs()
        distance[~torch.isfinite(log_probs)] = float("inf")
        order = torch.argsort(distance, stable=True)
        cumulative = probs[order].cumsum(0)
        # Keep up to and including the token that takes the mass past p.
        keep = int((cumulative <= p).sum()) + 1
        return _keep_sorted_prefix(logits, order, keep)


class TopPStep(SamplerStep):
    name = "top_p"
    order = 40
    params = {"top_p": ParamSpec(float, 0.9, help="nucleus: smallest set with mass >= p")}
    skip_when_greedy = True

    def apply(self, logits: torch.Tensor, ctx: SamplerContext) -> torch.Tensor:
        p = ctx.options["top_p"]
        if p >= 1.0:
            return logits
        probs = torch.softmax(logits, dim=-1)
        sorted_probs, order = torch.sort(probs, descending=True, stable=True)
        mass_before = sorted_probs.cumsum(0) - sorted_probs
        keep = int((mass_before < p).sum())
        return _keep_sorted_prefix(logits, order, keep)


class MinPStep(SamplerStep):
    name = "min_p"
    order = 50
    params = {"min_p": ParamSpec(float, 0.0, help="drop tokens below min_p * top probability")}
    skip_when_greedy = True

    def apply(self, logits: torch.Tensor, ctx: SamplerContext) -> torch.Tensor:
        p = ctx.options["min_p"]
        if p <= 0.0:
            return logits
        probs = torch.softmax(logits, dim=-1)
        threshold = probs.max() * p
        return logits.masked_fill(probs < threshold, NEG_INF)


class TemperatureStep(SamplerStep):
    name = "temperature"
    order = 60
    params = {"temperature": ParamSpec(float, 0.8, help="0 = greedy")}
    skip_when_greedy = True  # temperature 0 is handled by the Sampler as an argmax

    def apply(self, logits: torch.Tensor, ctx: SamplerContext) -> torch.Tensor:
        t = ctx.options["temperature"]
        if t <= 0 or t == 1.0:
            return logits
        return logits / t


@hookimpl
def exl3_samplers() -> list[SamplerStep]:
    return [PenaltiesStep(), DryStep(), TopKStep(), TypicalStep(), TopPStep(), MinPStep(),
            XtcStep(), TemperatureStep()]
