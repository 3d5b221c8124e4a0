"""Perplexity and KL divergence over fixed token windows (for `exl3 bench --ppl`).

Public API:
- ``token_windows(token_ids, window=2048, count=None) -> LongTensor[N, window]``:
  non-overlapping windows from the start of the stream.
- ``evaluate(model, windows, reference=None, batch=1) -> QualityResult``: perplexity
  of ``model`` on every next-token prediction inside the windows; with ``reference``
  (another CausalLM on the same tokens) the mean KL(reference || model) and the top-1
  agreement. Works with any object whose ``forward(ids[B, T]) -> logits[B, T, V]``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class QualityResult:
    perplexity: float
    tokens: int
    kl: float | None = None
    top1_agreement: float | None = None


def token_windows(token_ids: list[int], window: int = 2048, count: int | None = None) -> torch.Tensor:
    n = len(token_ids) // window
    if count is not None:
        n = min(n, count)
    if n == 0:
        raise ValueError(f"text has {len(token_ids)} tokens, fewer than one {window}-token window")
    return torch.tensor(token_ids[: n * window], dtype=torch.long).view(n, window)


@torch.inference_mode()
def evaluate(model, windows: torch.Tensor, reference=None, batch: int = 1) -> QualityResult:
    nll, kl, agree, count = 0.0, 0.0, 0, 0
    for start in range(0, windows.shape[0], batch):
        ids = windows[start : start + batch]
        logits = model(ids).float()[:, :-1]
        targets = ids[:, 1:].to(logits.device)
        logp = F.log_softmax(logits, dim=-1)
        nll += float(-logp.gather(-1, targets[..., None]).sum())
        count += targets.numel()
        if reference is not None:
            ref_logp = F.log_softmax(reference(ids).float()[:, :-1].to(logp.device), dim=-1)
            kl += float((ref_logp.exp() * (ref_logp - logp)).sum())
            agree += int((ref_logp.argmax(-1) == logp.argmax(-1)).sum())
    result = QualityResult(math.exp(nll / count), count)
    if reference is not None:
        result.kl, result.top1_agreement = kl / count, agree / count
    return result
