"""A scaled-down residual stream for float16 runs of Gemma-style models.

Gemma 2/3 scale their embeddings by sqrt(hidden_size) and norm each attention and MLP
output (the "sandwich") before adding it to the residual stream, so nothing bounds the
stream itself: in Gemma 3 270M it passes float16's largest value (65,504) around layer 7
of an ordinary prompt (about 104,000 at its peak in float32), and every logit after it is
NaN. bfloat16 has the range but a quarter of float16's precision.

Here the stream carries ``x / 2**shift`` instead of ``x``. Every reader of the stream is
an RMSNorm (the input and pre-MLP norms of each layer, the final norm) and every writer
is the embedding or a sandwich norm, so the whole model computes the same function
when:
- the embedding is multiplied by ``2**-shift``: text rows in the same multiply as
  Gemma's sqrt(hidden_size) (``CausalLM.embed_scale``), image rows on their own
  (``CausalLM.residual_scale``);
- each sandwich norm's weight is multiplied by ``2**-shift`` (its output joins the stream);
- each reading norm's eps is divided by ``2**(2 * shift)`` (``rms(x / s)**2 + eps / s**2``
  is ``(rms(x)**2 + eps) / s**2``).
Scaling by a power of two is exact in floating point (no value here comes near the
subnormal range), so a float32 run of the scaled model gives the same bits as the
unscaled one; in float16 the stream keeps its relative precision and fits.
"""

from __future__ import annotations

import torch
from torch import nn

from exl3cli.engine.layers.norm import RMSNorm

# 2**-6: Gemma 3 270M's stream peaks near 104,000 (1,600 scaled), leaving the larger
# Gemmas a 40x margin under float16's 65,504.
RESIDUAL_SHIFT = 6


def wants_residual_scale(spec: object, dtype: torch.dtype) -> bool:
    """Whether a model of this family in this activation dtype needs the scaled stream:
    float16 with sandwich norms behind real pre-norms (Gemma 2/3; EXAONE 4 has no
    pre-norm, so its sublayers read the stream itself and cannot take a scaled one)."""
    return (dtype == torch.float16 and bool(getattr(spec, "sandwich_norm", False))
            and not getattr(spec, "post_norm", False))


def _norms(layer: nn.Module) -> tuple[RMSNorm, RMSNorm, RMSNorm, RMSNorm] | None:
    names = ("input_norm", "post_attention_norm", "attention_out_norm", "mlp_out_norm")
    norms = tuple(getattr(layer, name, None) for name in names)
    if not all(type(norm) is RMSNorm and norm.weight.dim() == 1 for norm in norms):
        return None
    return norms  # type: ignore[return-value]


def scale_residual_stream(model: nn.Module, shift: int = RESIDUAL_SHIFT) -> bool:
    """Fold ``2**-shift`` into `model` (a CausalLM) as the module docstring says, before
    its first forward. Returns False, changing nothing, when a layer is not the
    pre-norm + sandwich shape the fold needs."""
    plans = [_norms(layer) for layer in model.layers]
    final = getattr(model, "final_norm", None)
    if not plans or any(plan is None for plan in plans) or type(final) is not RMSNorm:
        return False
    down, eps_down = 2.0 ** -shift, 2.0 ** (-2 * shift)
    for reader_a, reader_b, writer_a, writer_b in plans:  # type: ignore[misc]
        for writer in (writer_a, writer_b):
            writer.weight.mul_(down)
        for reader in (reader_a, reader_b):
            reader.eps *= eps_down
    final.eps *= eps_down
    model.residual_scale = down  # image rows (vision/image_tokens.py)
    model.embed_scale = down if model.embed_scale is None else model.embed_scale * down
    return True
