"""The one seam between a model's forward step and its KV cache: `AttentionCache`.

`CausalLM.forward(input_ids, cache)` takes either no cache (every row a whole sequence
from position 0) or an `AttentionCache`: a step over paged sequences that knows their
positions, writes each layer's new keys/values and attends over each sequence's
history. The implementations are the general paged step (`paged_attention.PagedBatch`
and its draft-verifying subclass `generation.speculative.VerifyingBatch`), the
fixed-shape decode step replayed from CUDA graphs (`generation.decode_step.
FixedDecodeStep`) and the image-run wrapper of image-text models
(`models.vision.image_tokens.BlockAttentionBatch`). The protocol lives here, on the
lowest floor that all of them and the layers can import.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class AttentionCache(Protocol):
    """What a forward step calls on its cache, in order: `prepare` once (positions for
    the rotary tables), `check_input` once, `attend` in every attention layer, then
    `advance` and (for last-token logits) `select_last`. Optional attributes:
    `text_only` (True: the step's ids are all in the vocabulary, no image rows to read;
    decode_step.FixedDecodeStep) and `rope_offsets` (the step's `prepare` positions
    already follow the images: no M-RoPE positions of its own)."""

    def prepare(self) -> tuple[torch.Tensor, int]:
        """(positions [1, N] of the step's N new tokens, span): `span` is the most key
        positions any sequence attends over (its cached length plus its new tokens)."""
        ...

    def check_input(self, input_ids: torch.Tensor) -> None:
        """ValueError unless `input_ids` has the shape this step was planned for."""
        ...

    def attend(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               window: int | None, *, softcap: float | None = None,
               scale: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """Write layer `layer`'s new keys/values [1, KV, N, D], then attend: query
        [1, H, N, D] -> [1, H, N, D]. `window`: the layer's sliding window (None: all
        keys). Without `softcap` and `sinks` the query already carries the score scale;
        with either, scores are q.k * `scale` (None: D**-0.5), soft-capped
        (cap * tanh(score / cap), Gemma 2), and `sinks` [H] join each softmax (gpt-oss)."""
        ...

    def advance(self) -> None:
        """After the layers: commit the step's tokens (or leave that to the caller)."""
        ...

    def select_last(self, hidden: torch.Tensor) -> torch.Tensor:
        """Hidden states [1, N, E] -> the rows logits are wanted for (each sequence's
        last new token, or more for a verifying step)."""
        ...
