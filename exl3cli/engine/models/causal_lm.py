"""The decoder-only transformer every supported family runs on."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from exl3cli.engine.kvcache.attention_cache import AttentionCache
from exl3cli.engine.layers.attention import Attention, AttentionStep
from exl3cli.engine.layers.cpu_exl3 import Exl3DecodePlan
from exl3cli.engine.layers.fused_layer import FusedDecodeLayer
from exl3cli.engine.layers.linear import GEMV_MAX_ROWS, DenseLinear, Linear, float_product
from exl3cli.engine.layers.mlp import GatedMLP
from exl3cli.engine.layers.norm import RMSNorm
from exl3cli.engine.layers.parallel import VocabShard
from exl3cli.engine.layers.rope import RotaryEmbedding
from exl3cli.engine.models.exl3_stack import Exl3DecodeStack
from exl3cli.engine.spec.architecture import ArchitectureSpec
from exl3cli.engine.spec.config import ModelConfig
from exl3cli.errors import UnsupportedArchitecture
from exl3cli.ops import cpu_kernels
from exl3cli.ops.host_memory import trim_host_heap

# A CPU forward of at least this many tokens hands the heap's free pages back after it.
TRIM_AFTER_TOKENS = 32


class DecoderLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then + mlp(norm(x)).

    With `attention_out_norm` and `mlp_out_norm` (Gemma's "sandwich") the attention and
    MLP outputs are normed too before their residual add; `post_attention_norm` is
    then the norm in front of the MLP (Gemma's pre_feedforward_layernorm)."""

    def __init__(self, input_norm: RMSNorm, attention: Attention,
                 post_attention_norm: RMSNorm, mlp: nn.Module,
                 attention_out_norm: RMSNorm | None = None,
                 mlp_out_norm: RMSNorm | None = None):
        super().__init__()
        if (attention_out_norm is None) != (mlp_out_norm is None):
            raise ValueError("sandwich norms come in pairs (attention and MLP outputs)")
        self.input_norm = input_norm
        self.attention = attention
        self.post_attention_norm = post_attention_norm
        self.mlp = mlp
        self.attention_out_norm = attention_out_norm
        self.mlp_out_norm = mlp_out_norm
        self._plan: _DecodePlan | None | bool = False  # False: not looked at yet
        self._fused: FusedDecodeLayer | None | bool = False  # the GPU decode path
        self._fused_modules: tuple[Any, ...] = (None, None, None, None)

    def forward(self, x: torch.Tensor, step: AttentionStep) -> torch.Tensor:
        batch, steps, hidden = x.shape
        if x.is_cuda:
            fused = self._fused_plan()
            if fused is not None and fused.accepts(x):
                return fused.forward(x, step)
        if (batch * steps <= GEMV_MAX_ROWS and x.dtype == torch.float32
                and x.device.type == "cpu"):
            plan = self._decode_plan()
            if plan is not None:
                return self._decode_rows(plan, x.reshape(batch * steps, hidden), step
                                         ).view(batch, steps, hidden)
        if self.attention_out_norm is not None and self.mlp_out_norm is not None:
            x = x + self.attention_out_norm(self.attention(self.input_norm(x), step))
            return x + self.mlp_out_norm(self.mlp(self.post_attention_norm(x)))
        # The residual add and the second norm are one pass (RMSNorm.add_and_norm).
        x, normed = self.post_attention_norm.add_and_norm(x, self.attention(self.input_norm(x), step))
        return x + self.mlp(normed)

    def _fused_plan(self) -> FusedDecodeLayer | None:
        """The GPU decode path of this layer, decided again whenever one of its
        projections was replaced (a LoRA adapter wraps them: the fused path then
        steps aside rather than skip the adapter)."""
        # getattr: the converter swaps in stand-ins without these (convert/engine_layer.py).
        modules = (getattr(self.attention, "qkv", None), getattr(self.attention, "o", None),
                   getattr(self.mlp, "gate_up", None), getattr(self.mlp, "down", None))
        if self._fused is False or any(a is not b for a, b in zip(modules, self._fused_modules,
                                                                   strict=True)):
            self._fused = FusedDecodeLayer.of(self)
            self._fused_modules = modules
        return self._fused  # type: ignore[return-value]

    def _decode_rows(self, plan: _DecodePlan, rows: torch.Tensor,
                     step: AttentionStep) -> torch.Tensor:
        """A few tokens (decode) on the CPU kernels: norm, qkv, rope in one call, the
        cache write and attention, then o, residual, norm, MLP, residual in one call."""
        attention = self.attention
        batch, steps = step.positions.shape
        dim, heads, kv_heads = attention.head_dim, attention.num_heads, attention.num_kv_heads
        qkv = plan.norm_qkv_rope(
            rows, self.input_norm, step.cos.reshape(-1, dim), step.sin.reshape(-1, dim), dim,
            heads + kv_heads,
        ).view(batch, steps, heads + 2 * kv_heads, dim)
        attended = attention.attend(qkv[:, :, : heads + kv_heads], qkv[:, :, heads + kv_heads :],
                                    step)
        return plan.out_mlp(rows, attended.reshape(rows.shape[0], -1), self.post_attention_norm)

    def _decode_plan(self) -> _DecodePlan | Exl3DecodePlan | None:
        """The weights for `_decode_rows` when this layer is the plain Llama shape on the
        CPU kernels (float32 norms, no q/k norm, SiLU, packed dense linears or EXL3 ones
        kept compressed; none of Gemma's options: sandwich or 1 + w norms, score scale
        or soft-cap, own rope for sliding layers)."""
        if self._plan is False:
            self._plan = _DecodePlan.of(self)
        return self._plan  # type: ignore[return-value]


def softcap_logits(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    """Gemma 2's final soft-cap: cap * tanh(logits / cap); identity when `cap` is None
    (the quantizer's sensitivity pass applies it too)."""
    if cap is None:
        return logits
    return torch.tanh(logits / cap) * cap


class _DecodePlan(NamedTuple):
    qkv: cpu_kernels.GemvWeights
    o: cpu_kernels.GemvWeights
    gate_up: cpu_kernels.GemvWeights
    down: cpu_kernels.GemvWeights

    def norm_qkv_rope(self, rows: torch.Tensor, norm: RMSNorm, cos: torch.Tensor,
                      sin: torch.Tensor, dim: int, rot_heads: int) -> torch.Tensor:
        return cpu_kernels.norm_qkv_rope_cpu(rows, norm.weight, norm.eps, self.qkv, cos, sin,
                                             dim, rot_heads)

    def out_mlp(self, rows: torch.Tensor, attended: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
        return cpu_kernels.out_mlp_cpu(rows, attended, self.o, norm.weight, norm.eps,
                                       self.gate_up, self.down)

    @staticmethod
    def of(layer: DecoderLayer) -> _DecodePlan | Exl3DecodePlan | None:
        attention, mlp = layer.attention, layer.mlp
        if not isinstance(mlp, GatedMLP):  # a mixture of experts has no single gate_up
            return None
        norms = (layer.input_norm, layer.post_attention_norm)
        linears = (attention.qkv, attention.o, mlp.gate_up, mlp.down)
        if (attention.qk_norm is not None or not getattr(mlp, "_silu", False)
                or not attention.rope):
            return None
        if (layer.attention_out_norm is not None or attention.scale is not None
                or attention.softcap is not None or attention.local_rope
                or attention.sinks is not None or attention.position_query_scale is not None):
            return None
        if not all(type(n) is RMSNorm and n._fused and not n.unit_offset for n in norms):
            return None
        hidden = layer.input_norm.weight.numel()
        if attention.o.out_features != hidden or mlp.down.out_features != hidden:
            return None
        if attention.head_dim > 512 or not cpu_kernels.available():
            return None
        packed = [lin.gemv_weights() if isinstance(lin, DenseLinear) else None
                  for lin in linears]
        if any(p is None for p in packed):
            return Exl3DecodePlan.of(*linears)  # EXL3 linears kept compressed, or None
        return _DecodePlan(*packed)


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
        compute_dtype: torch.dtype | None = None,
    ):
        """`compute_dtype`: the activations' dtype when the embedding is stored in
        another (a bfloat16 table for float32 compute: half the bytes); default the
        embedding's dtype."""
        super().__init__()
        self.config = config
        self._compute_dtype = compute_dtype or embed_weight.dtype
        self.spec = spec
        self.register_buffer("embed_weight", embed_weight, persistent=False)
        # Tied embeddings share the storage: no second copy of the largest matrix.
        self.lm_head = lm_head if isinstance(lm_head, Linear) else DenseLinear(lm_head)
        self.layers = nn.ModuleList(layers)
        self.final_norm = final_norm
        self._head_gemv: bool | None = None  # see _project
        self._stack: Any = False  # models/exl3_stack.Exl3DecodeStack, None, False: not yet
        self.rotary = RotaryEmbedding(
            config.head_dim, config.rope_theta, config.rope_scaling,
            config.max_position_embeddings, embed_weight.device, self._compute_dtype,
        )
        # M-RoPE (Qwen2.5-VL): frequency sections follow a token's temporal, height and
        # width positions, which image tokens give (`images.rope_positions`); text alone
        # has the same position on all three, which is plain rope.
        self.mrope_section = config.mrope_section
        if self.mrope_section is not None and (
                2 * sum(self.mrope_section) != config.head_dim
                or config.partial_rotary_factor != 1.0 or spec.rope_interleaved):
            raise UnsupportedArchitecture(f"M-RoPE sections {self.mrope_section} over "
                                          f"head_dim {config.head_dim} (all of it rotating, "
                                          "halves paired) are needed")
        # Sliding layers with their own rope (Gemma 3): a second table, looked up with
        # the first on every step so both grow (and bump `version`) together.
        self.local_rotary: RotaryEmbedding | None = None
        if any(layer.attention.local_rope for layer in layers):
            if config.sliding_rope_theta is None:
                raise ValueError("layers use a sliding-layer rope the config does not give")
            self.local_rotary = RotaryEmbedding(
                config.head_dim, config.sliding_rope_theta,
                config.sliding_rope_scaling or {"rope_type": "default"},
                config.max_position_embeddings, embed_weight.device, self._compute_dtype,
            )
        # Gemma: embeddings times sqrt(hidden_size), rounded to the activation dtype.
        self.embed_scale = (
            torch.tensor(config.hidden_size**0.5, dtype=self._compute_dtype).item()
            if spec.embed_scale else None
        )
        # engine/models/residual_scale.py: the stream's scale (a power of two, also folded
        # into embed_scale) when a float16 Gemma carries x / 64; None: the stream is x.
        self.residual_scale: float | None = None
        self.final_softcap = config.final_logit_softcapping
        # Tensor parallel (engine/models/shard.py): this rank's slice of the vocabulary
        # (embedding rows, head columns), a layers/parallel.VocabShard; None: all of it.
        self.vocab_shard: VocabShard | None = None
        # A layer split (layer_split.LayerStages): the layers' devices in turn; None: one.
        self.stages: Any = None
        # An image-text model's encoded images (vision/image_tokens.ImageTokens): token
        # ids past the vocabulary that embed as image rows; None for text only.
        self.images: Any = None

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
        return self._compute_dtype

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        cache: AttentionCache | None = None,
        *,
        last_logits_only: bool = False,
    ) -> torch.Tensor:
        """Logits [B, T, V] (float32) for input_ids [B, T].

        Without a cache, each row is one whole sequence from position 0. With a cache (an
        AttentionCache: a paged step such as paged_attention.PagedBatch or
        decode_step.FixedDecodeStep),
        input_ids is [1, N]: the new tokens of several sequences back to back, each at
        its own positions, attending to its pages; `last_logits_only` then gives
        [1, num_sequences, V] (without a cache: [B, 1, V], each row's last token).
        """
        batch, steps = input_ids.shape
        input_ids = input_ids.to(self.device)
        if cache is None:
            step = self._plan_step(batch, steps, input_ids)
        else:
            if self.images is not None:  # image runs in prompt chunks: bidirectional
                cache = self.images.wrap_step(cache, input_ids)
            step = self._plan_paged_step(cache)
            cache.check_input(input_ids)
        # A step of sampled tokens only (`text_only`: decode steps) reads no image rows,
        # and so never asks the device whether it holds any (no sync inside a CUDA graph).
        text_only = cache is not None and getattr(cache, "text_only", False)
        hidden = self._embed_text(input_ids) if text_only else self._embed(input_ids)
        hidden = self._run_layers(hidden, step)
        if cache is not None:
            cache.advance()
        if last_logits_only:
            hidden = cache.select_last(hidden) if cache is not None else hidden[:, -1:]
        hidden = self.final_norm(hidden)
        logits = self._softcap(self._project(hidden).float())
        if batch * steps >= TRIM_AFTER_TOKENS and self.device.type == "cpu":
            trim_host_heap()  # the prompt's workspace (ops/host_memory.py)
        return logits

    def prepare_decode(self, max_seq_len: int) -> bool:
        """Build the rotary table for `max_seq_len` positions ahead of fixed-shape decode
        steps (decode_step.py, CUDA graphs hold its pointers); False when the model
        cannot run them (dynamic NTK rope rebuilds its table as the sequence grows)."""
        if self.rotary.dynamic or (self.local_rotary is not None and self.local_rotary.dynamic):
            return False
        zero = torch.zeros(1, dtype=torch.long, device=self.device)
        self.rotary.lookup(zero, max_seq_len)
        if self.local_rotary is not None:
            self.local_rotary.lookup(zero, max_seq_len)
        return True

    @torch.inference_mode()
    def hidden_states(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Final-norm hidden states [B, T, H] (float32) of input_ids [B, T], without a
        cache (embeddings pool these instead of projecting them to the vocabulary)."""
        batch, steps = input_ids.shape
        input_ids = input_ids.to(self.device)
        step = self._plan_step(batch, steps, input_ids)
        hidden = self._run_layers(self._embed(input_ids), step)
        return self.final_norm(hidden).float()

    def _run_layers(self, hidden: torch.Tensor, step: AttentionStep) -> torch.Tensor:
        if self.stages is not None:  # a layer split over devices (layer_split.py)
            return self.stages.run(self.layers, hidden, step)
        if step.cache is not None and hidden.device.type == "cpu":
            if self._stack is False:  # the whole stack in one op (models/exl3_stack.py)
                self._stack = Exl3DecodeStack.of(self.layers, DecoderLayer)
            if self._stack is not None:
                out = self._stack.run(hidden, step, self.layers)  # type: ignore[union-attr]
                if out is not None:
                    return out
        for layer in self.layers:
            hidden = layer(hidden, step)
        return hidden

    def _plan_step(self, batch: int, steps: int,
                   input_ids: torch.Tensor | None = None) -> AttentionStep:
        """A whole sequence per row from position 0, no cache."""
        positions = torch.arange(steps, device=self.device).expand(batch, steps)
        images = self.images if input_ids is not None else None
        rope = images.rope_positions(input_ids) if images is not None else None
        step = self._step(positions, steps, 0, None, rope)
        if images is not None:
            step.blocks = images.block_ids(input_ids)
        return step

    def _plan_paged_step(self, batch: AttentionCache) -> AttentionStep:
        positions, span = batch.prepare()
        rope = self.images.paged_rope_positions(batch) if self.images is not None else None
        return self._step(positions.to(self.device), span, None, batch, rope)

    def _step(self, positions: torch.Tensor, span: int, start: int | None,
              cache: AttentionCache | None,
              rope: torch.Tensor | None = None) -> AttentionStep:
        """The AttentionStep for `positions` [B, T]: rotary tables and the cache.
        `rope` [3, B, T]: M-RoPE positions of the tokens (else `positions` rotate)."""
        if rope is not None:
            if self.mrope_section is None or self.local_rotary is not None:
                raise ValueError("three-axis rotary positions for a model without M-RoPE")
            cos, sin = self.rotary.lookup_sections(rope, span, self.mrope_section)
        else:
            cos, sin = self.rotary.lookup(positions, span)
        local_cos = local_sin = None
        if self.local_rotary is not None:
            local_cos, local_sin = (t.unsqueeze(2) for t in self.local_rotary.lookup(positions, span))
        return AttentionStep(
            positions=positions, cos=cos.unsqueeze(2), sin=sin.unsqueeze(2),
            span=span, start=start, cache=cache, local_cos=local_cos, local_sin=local_sin,
        )

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.images is not None:  # image ids read their rows, text ids the table
            return self.images.embed(input_ids, self._embed_text, self.residual_scale)
        return self._embed_text(input_ids)

    def _embed_text(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.vocab_shard is not None:
            hidden = self.vocab_shard.embed(input_ids, self.embed_weight, self._compute_dtype)
        else:
            hidden = F.embedding(input_ids, self.embed_weight).to(self._compute_dtype)
        return hidden if self.embed_scale is None else hidden * self.embed_scale

    def _softcap(self, logits: torch.Tensor) -> torch.Tensor:
        return softcap_logits(logits, self.final_softcap)

    def _project(self, hidden: torch.Tensor) -> torch.Tensor:
        """The vocabulary projection (every rank's slice gathered under tensor parallel)."""
        logits = self._project_local(hidden)
        return logits if self.vocab_shard is None else self.vocab_shard.gather(logits)

    def _project_local(self, hidden: torch.Tensor) -> torch.Tensor:
        """This model's head. A decode step on CPU with an unpacked float32/bf16 head
        (the tied embedding: no packed copy of the largest matrix) streams the row-major
        weight through a GEMV kernel, about twice as fast as F.linear there."""
        head = self.lm_head
        rows = hidden.reshape(-1, hidden.shape[-1])
        if (rows.shape[0] <= GEMV_MAX_ROWS and hidden.dtype == torch.float32
                and hidden.device.type == "cpu" and isinstance(head, DenseLinear)
                and head.cpu_weights is None and head.bias is None
                and head.weight.dtype in (torch.float32, torch.bfloat16)
                and head.weight.is_contiguous()):
            if self._head_gemv is None:
                self._head_gemv = cpu_kernels.available()
            if self._head_gemv:
                logits = cpu_kernels.gemv_rows_cpu(rows.contiguous(), head.weight)
                return logits.view(*hidden.shape[:-1], logits.shape[-1])
        if (hidden.is_cuda and type(head) is DenseLinear and head.cpu_weights is None
                and head.bias is None):
            return float_product(hidden, head.weight)  # float32 logits, not half-rounded
        return head(hidden)
