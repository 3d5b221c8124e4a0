"""Multi-head latent attention (DeepSeek-V2/V3) as the engine's ordinary attention.

MLA projects keys and values through a small latent: kv_a_proj_with_mqa gives a latent
of kv_lora_rank values (RMS-normed) plus one rotary key part shared by all heads;
kv_b_proj expands the latent into each head's key part without rope and its value.
Queries come from q_proj, or through a latent of their own (q_a_proj, q_a_layernorm,
q_b_proj). Each head's query and key are [rope part | no-rope part]: the rope part
rotates (pairs interleaved with `rope_interleave`), the rest does not.

The simplest correct way onto the paged KV cache: expand the latent to per-head keys
and values before caching. `LatentQKV` is the layer's qkv projection: it returns
q, k and v heads of head_dim = qk_nope_head_dim + qk_rope_head_dim in the engine's
rope layout (rotary pairs first in each half, rope.rope_permutation), values padded
with zeros to head_dim, so the cache, the rotary tables (partial rotary over the rope
part) and every attention path need no MLA case. `HeadSlice` drops the padding before
o_proj. The cost is cache memory: heads x head_dim keys and values per token instead of
the latent's kv_lora_rank + qk_rope_head_dim (DeepSeek-V3: 128 x 192 x 2 against 576);
caching the latent and absorbing kv_b_proj into the query and output would save it.

Public API:
- ``mla_head_dim(raw) -> int``; ``mla_softmax_scale(raw, head_dim) -> float``.
- ``LatentQKV(q, q_a, q_norm, q_b, kv_a, kv_norm, kv_b, heads, nope, rope, v_dim,
  interleaved)``; ``HeadSlice(o, heads, head_dim, v_dim)`` (``.narrow(x)``: o_proj's input).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from exl3cli.engine.layers.linear import Linear
from exl3cli.engine.layers.rope import rope_permutation


def mla_head_dim(raw: dict[str, Any]) -> int:
    """Query/key head width: qk_nope_head_dim + qk_rope_head_dim."""
    return int(raw["qk_nope_head_dim"]) + int(raw["qk_rope_head_dim"])


def mla_softmax_scale(raw: dict[str, Any], head_dim: int) -> float:
    """head_dim**-0.5, times mscale(factor, mscale_all_dim)**2 under YaRN (DeepSeek)."""
    scale = head_dim**-0.5
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    rope_type = params.get("rope_type") or params.get("type") or "default"
    all_dim = params.get("mscale_all_dim")
    factor = float(params.get("factor") or 1.0)
    if rope_type != "default" and all_dim and factor > 1.0:
        mscale = 0.1 * float(all_dim) * math.log(factor) + 1.0
        scale *= mscale * mscale
    return scale


class LatentQKV(nn.Module):
    """x -> [q heads | k heads | v heads] (each [heads, nope + rope]), see the module
    docstring. `q` is q_proj, or None with q_a / q_norm / q_b given."""

    def __init__(self, q: Linear | None, q_a: Linear | None, q_norm: nn.Module | None,
                 q_b: Linear | None, kv_a: Linear, kv_norm: nn.Module, kv_b: Linear,
                 heads: int, nope: int, rope: int, v_dim: int, interleaved: bool):
        super().__init__()
        if q is None and (q_a is None or q_norm is None or q_b is None):
            raise ValueError("MLA queries need q_proj or q_a_proj, q_a_layernorm, q_b_proj")
        self.q, self.q_a, self.q_norm, self.q_b = q, q_a, q_norm, q_b
        self.kv_a, self.kv_norm, self.kv_b = kv_a, kv_norm, kv_b
        self.heads, self.nope, self.rope, self.v_dim = heads, nope, rope, v_dim
        self.head_dim = nope + rope
        if v_dim > self.head_dim:
            raise ValueError(f"v_head_dim {v_dim} wider than the key head {self.head_dim}")
        self.kv_rank = kv_a.out_features - rope
        # Checkpoint order [rope | nope] -> the engine's rope layout.
        self.register_buffer("order", rope_permutation(self.head_dim, rope, interleaved),
                             persistent=False)
        self.out_features = 3 * heads * self.head_dim

    def _queries(self, x: torch.Tensor) -> torch.Tensor:
        if self.q is not None:
            return self.q(x)
        return self.q_b(self.q_norm(self.q_a(x)))  # type: ignore[misc]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        heads, nope = self.heads, self.nope
        q = self._queries(x).view(*lead, heads, self.head_dim)
        q = torch.cat([q[..., nope:], q[..., :nope]], dim=-1)  # [rope | nope]
        latent, k_rope = self.kv_a(x).split([self.kv_rank, self.rope], dim=-1)
        kv = self.kv_b(self.kv_norm(latent)).view(*lead, heads, nope + self.v_dim)
        k_nope, v = kv.split([nope, self.v_dim], dim=-1)
        k = torch.cat([k_rope[..., None, :].expand(*lead, heads, self.rope), k_nope], dim=-1)
        v = F.pad(v, (0, self.head_dim - self.v_dim))
        order = self.order
        return torch.cat([q[..., order], k[..., order], v], dim=-2).reshape(
            *lead, self.out_features)


class HeadSlice(nn.Module):
    """o_proj over attention output whose value heads were padded to `head_dim`."""

    def __init__(self, o: Linear, heads: int, head_dim: int, v_dim: int):
        super().__init__()
        self.o, self.heads, self.head_dim, self.v_dim = o, heads, head_dim, v_dim
        self.out_features = o.out_features

    def narrow(self, x: torch.Tensor) -> torch.Tensor:
        """The value heads of `x` without their padding: what o_proj reads."""
        lead = x.shape[:-1]
        heads = x.view(*lead, self.heads, self.head_dim)[..., : self.v_dim]
        return heads.reshape(*lead, self.heads * self.v_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.o(self.narrow(x))
