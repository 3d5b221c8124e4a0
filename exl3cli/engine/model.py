"""The decoder-only transformer every supported family runs on."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from exl3cli.engine.architecture import ArchitectureSpec
from exl3cli.engine.attention import Attention, AttentionStep
from exl3cli.engine.cache import DeviceIndexedWrites, KVCache
from exl3cli.engine.config import ModelConfig
from exl3cli.engine.linear import DenseLinear, Linear
from exl3cli.engine.mlp import GatedMLP
from exl3cli.engine.norm import RMSNorm
from exl3cli.engine.rope import RotaryEmbedding


class DecoderLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then + mlp(norm(x))."""

    def __init__(self, input_norm: RMSNorm, attention: Attention,
                 post_attention_norm: RMSNorm, mlp: GatedMLP):
        super().__init__()
        self.input_norm = input_norm
        self.attention = attention
        self.post_attention_norm = post_attention_norm
        self.mlp = mlp

    def forward(self, x: torch.Tensor, step: AttentionStep) -> torch.Tensor:
        x = x + self.attention(self.input_norm(x), step)
        return x + self.mlp(self.post_attention_norm(x))


class CausalLM(nn.Module):
    """Token ids in, float32 next-token logits out; built by loader.load_causal_lm."""

    def __init__(
        self,
        config: ModelConfig,
        spec: ArchitectureSpec,
        embed_weight: torch.Tensor,
        layers: list[DecoderLayer],
        final_norm: RMSNorm,
        lm_head: torch.Tensor | Linear,
    ):
        super().__init__()
        self.config = config
        self.spec = spec
        self.register_buffer("embed_weight", embed_weight, persistent=False)
        # Tied embeddings share the storage: no second copy of the largest matrix.
        self.lm_head = lm_head if isinstance(lm_head, Linear) else DenseLinear(lm_head)
        self.layers = nn.ModuleList(layers)
        self.final_norm = final_norm
        self.rotary = RotaryEmbedding(
            config.head_dim, config.rope_theta, config.rope_scaling,
            config.max_position_embeddings, embed_weight.device, embed_weight.dtype,
        )

    @property
    def lm_head_weight(self) -> torch.Tensor | None:
        """The head's (vocab, hidden) matrix when it holds one (dense or dequantized)."""
        dense = self.lm_head.dense_weight()
        return None if dense is None else dense[0]

    @property
    def device(self) -> torch.device:
        return self.embed_weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_weight.dtype

    def new_cache(self, batch_size: int, max_seq_len: int) -> KVCache:
        """An empty cache for `batch_size` rows of up to `max_seq_len` positions each."""
        return KVCache(
            len(self.layers), batch_size, max_seq_len, self.config.num_kv_heads,
            self.config.head_dim, self.dtype, self.device,
        )

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        cache: KVCache | None = None,
        *,
        input_lengths: Sequence[int] | None = None,
        last_logits_only: bool = False,
    ) -> torch.Tensor:
        """Logits [B, T, V] (float32) for input_ids [B, T].

        With a cache, row b's tokens take positions `cache.lengths[b] ..`, and row b
        advances by T, or by `input_lengths[b]` when rows are right-padded to a common
        T (padding positions are written but never attended to, and later overwritten).
        `last_logits_only` returns [B, 1, V]: each row's last valid token only, which
        saves the vocabulary projection for the rest of a prompt.

        `cache` may also be a paged step (paged_attention.PagedBatch): input_ids is then
        [1, N], the new tokens of several sequences back to back, each at its own
        positions; `last_logits_only` gives [1, num_sequences, V].
        """
        batch, steps = input_ids.shape
        input_ids = input_ids.to(self.device)
        if input_lengths is not None:
            input_lengths = [int(n) for n in input_lengths]
            if len(input_lengths) != batch or not all(0 <= n <= steps for n in input_lengths):
                raise ValueError(f"input_lengths must hold {batch} values in 0..{steps}")
        paged = getattr(cache, "paged", False)
        step = self._plan_paged_step(cache) if paged else self._plan_step(batch, steps, cache)
        if paged:
            cache.check_input(input_ids)
        hidden = F.embedding(input_ids, self.embed_weight)
        for layer in self.layers:
            hidden = layer(hidden, step)
        if cache is not None:
            cache.advance(input_lengths if input_lengths is not None else [steps] * batch)
        if last_logits_only:
            hidden = cache.select_last(hidden) if paged else self._last_valid(hidden, input_lengths)
        hidden = self.final_norm(hidden)
        return self.lm_head(hidden).float()

    @torch.inference_mode()
    def decode_step(self, input_ids: torch.Tensor, cache: KVCache, span: int) -> torch.Tensor:
        """One token per row with fixed shapes and no host syncs, so a CUDA graph can
        capture it: logits [B, V] (float32) for input_ids [B, 1].

        Positions are read from `cache.lengths` on the device, keys are written there,
        attention covers the first `span` cache positions (masked past each row's
        length), and `cache.lengths` advances by one on the device only: the caller
        mirrors that with `cache.mark_advanced`. The rotary table must already cover
        `span` (see `prepare_decode`)."""
        positions = cache.lengths[:, None]
        cos, sin = self.rotary.lookup(positions, span)
        step = AttentionStep(
            positions=positions, cos=cos.unsqueeze(2), sin=sin.unsqueeze(2),
            span=span, start=None, cache=DeviceIndexedWrites(cache),
        )
        hidden = F.embedding(input_ids, self.embed_weight)
        for layer in self.layers:
            hidden = layer(hidden, step)
        logits = self.lm_head(self.final_norm(hidden)).float()
        cache.lengths.add_(1)
        return logits[:, -1]

    def prepare_decode(self, max_seq_len: int) -> bool:
        """Build the rotary table for `max_seq_len` positions ahead of `decode_step`;
        False when the model cannot run fixed-shape steps (dynamic NTK rope rebuilds
        its table as the sequence grows)."""
        if self.rotary.dynamic:
            return False
        self.rotary.lookup(torch.zeros(1, dtype=torch.long, device=self.device), max_seq_len)
        return True

    @torch.inference_mode()
    def hidden_states(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Final-norm hidden states [B, T, H] (float32) of input_ids [B, T], without a
        cache (embeddings pool these instead of projecting them to the vocabulary)."""
        batch, steps = input_ids.shape
        step = self._plan_step(batch, steps, None)
        hidden = F.embedding(input_ids.to(self.device), self.embed_weight)
        for layer in self.layers:
            hidden = layer(hidden, step)
        return self.final_norm(hidden).float()

    def _plan_step(self, batch: int, steps: int, cache: KVCache | None) -> AttentionStep:
        offsets = torch.arange(steps, device=self.device)
        if cache is None:
            start, span = 0, steps
            positions = offsets.expand(batch, steps)
        else:
            if cache.batch_size != batch:
                raise ValueError(f"cache has {cache.batch_size} rows, input has {batch}")
            cache.check_room(steps)
            start = cache.uniform_length()
            span = max(cache.row_lengths()) + steps
            if start is not None:
                positions = (offsets + start).expand(batch, steps)
            else:
                positions = cache.lengths[:, None] + offsets
        cos, sin = self.rotary.lookup(positions, span)
        return AttentionStep(
            positions=positions, cos=cos.unsqueeze(2), sin=sin.unsqueeze(2),
            span=span, start=start, cache=cache,
        )

    def _plan_paged_step(self, batch: Any) -> AttentionStep:
        positions = batch.positions.to(self.device)
        cos, sin = self.rotary.lookup(positions, batch.span)
        return AttentionStep(
            positions=positions, cos=cos.unsqueeze(2), sin=sin.unsqueeze(2),
            span=batch.span, start=None, cache=batch,
        )

    @staticmethod
    def _last_valid(hidden: torch.Tensor, input_lengths: list[int] | None) -> torch.Tensor:
        if input_lengths is None:
            return hidden[:, -1:]
        index = torch.tensor([max(n - 1, 0) for n in input_lengths], device=hidden.device)
        return hidden[torch.arange(hidden.shape[0], device=hidden.device), index].unsqueeze(1)
