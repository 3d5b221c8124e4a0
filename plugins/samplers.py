"""Built-in sampler steps (registered through the exl3cli entry-point group).

Order follows llama.cpp's default chain, which Ollama used: penalties, top_k,
typical_p, top_p, min_p, temperature. Penalties use Ollama's semantics: within the
last `repeat_last_n` tokens (0 = off, -1 = all), a seen token's logit is divided by
`repeat_penalty` when positive (multiplied when negative), lowered by
`frequency_penalty` per occurrence and by `presence_penalty` once.
"""

from __future__ import annotations

import torch

from exl3cli.engine.sampling import ParamSpec, SamplerContext, SamplerStep
from exl3cli.plugins import hookimpl

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
    return [PenaltiesStep(), TopKStep(), TypicalStep(), TopPStep(), MinPStep(), TemperatureStep()]
