"""Gemma 3's images: SigLIP tower, then the multimodal projector (average-pool the
patch grid to mm_tokens_per_image tokens, RMS-normalise with x * (1 + w), project to the
language model's width), and the prompt spelling of an image that transformers'
Gemma3Processor writes: "\\n\\n<start_of_image>" + soft tokens + "<end_of_image>\\n\\n"
in place of each "<start_of_image>" of the rendered chat.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from exl3cli.engine.models.vision.siglip import SiglipConfig, SiglipVisionTower, load_siglip

ARCHITECTURE = "Gemma3ForConditionalGeneration"
# transformers' Gemma3ImageProcessor defaults, for keys preprocessor_config.json omits.
PROCESSOR_DEFAULTS: dict[str, Any] = {
    "size": {"height": 224, "width": 224}, "resample": 2, "rescale_factor": 1 / 255,
    "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
}
# Where a checkpoint keeps the tower and projector: hub checkpoints (and ExLlamaV3
# folders, which keep their names) at the top level with the tower under
# "vision_model."; transformers 4.52+ under "model."; transformers 5 writes the tower
# without "vision_model.".
_TOWERS = ("vision_tower.vision_model.", "model.vision_tower.vision_model.",
           "vision_tower.", "model.vision_tower.")


def exllamav3_name(name: str) -> str:
    """A tower or projector tensor under the name ExLlamaV3's Gemma 3 reads (the hub
    checkpoints' names): "vision_tower.vision_model.*", "multi_modal_projector.*"."""
    name = name.removeprefix("model.")
    if name.startswith("vision_tower.") and not name.startswith("vision_tower.vision_model."):
        return "vision_tower.vision_model." + name.removeprefix("vision_tower.")
    return name


class Gemma3Projector(nn.Module):
    """[N, patches, vision hidden] -> [N, tokens, text hidden]."""

    def __init__(self, norm_weight: torch.Tensor, projection: torch.Tensor, eps: float,
                 patches_per_side: int, tokens_per_image: int):
        super().__init__()
        side = int(round(tokens_per_image**0.5))
        if side * side != tokens_per_image or patches_per_side % side:
            raise ValueError(f"mm_tokens_per_image {tokens_per_image} does not pool a "
                             f"{patches_per_side}x{patches_per_side} patch grid")
        self.register_buffer("norm_weight", norm_weight, persistent=False)
        self.register_buffer("projection", projection, persistent=False)  # [vision, text]
        self.eps = eps
        self.patches_per_side = patches_per_side
        self.kernel = patches_per_side // side

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        batch, _, hidden = patches.shape
        grid = patches.transpose(1, 2).reshape(batch, hidden, self.patches_per_side,
                                               self.patches_per_side)
        pooled = F.avg_pool2d(grid, self.kernel, self.kernel).flatten(2).transpose(1, 2)
        x = pooled.float()
        normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        normed = (normed * (1.0 + self.norm_weight.float())).to(pooled.dtype)
        return torch.matmul(normed, self.projection).to(patches.dtype)


class Gemma3Vision(nn.Module):
    """pixels [N, 3, S, S] -> image embeddings [N, mm_tokens_per_image, text hidden];
    `prompt_text(count)` and `image_token` say how images sit in the prompt."""

    def __init__(self, tower: SiglipVisionTower, projector: Gemma3Projector,
                 tokens_per_image: int, boi: str, eoi: str, image_token: str):
        super().__init__()
        self.tower = tower
        self.projector = projector
        self.tokens_per_image = tokens_per_image
        self.placeholder = boi  # what the chat template writes where an image goes
        self.image_token = image_token
        self._spelled = f"\n\n{boi}{image_token * tokens_per_image}{eoi}\n\n"

    @torch.inference_mode()
    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.projector(self.tower(pixel_values))

    def embed_image(self, pixels: torch.Tensor) -> torch.Tensor:
        """One image's pixels [3, S, S] -> [mm_tokens_per_image, text hidden]."""
        return self(pixels.unsqueeze(0).to(self.projector.projection.device))[0]

    def token_grid(self, size: tuple[int, int], processor: Any) -> tuple[int, int]:
        """(rows, columns) of an image's tokens: the pooled grid, whatever its size."""
        side = self.projector.patches_per_side // self.projector.kernel
        return side, side

    def expand(self, text: str, grids: Sequence[tuple[int, int]] = ()) -> str:
        """The rendered chat with each placeholder spelled out as the image's tokens."""
        return text.replace(self.placeholder, self._spelled)


def load_gemma3_vision(raw: dict[str, Any], tensor: Callable[[str], torch.Tensor],
                       has: Callable[[str], bool], token_text: Callable[[int], str | None],
                       ) -> Gemma3Vision:
    """The vision half of a Gemma 3 image-text checkpoint: config.json as `raw`,
    tensors through `tensor(name)` / `has(name)`, token spellings by id."""
    config = SiglipConfig.from_dict(raw.get("vision_config") or {})
    prefix = next((p for p in _TOWERS if has(f"{p}post_layernorm.weight")), None)
    if prefix is None:
        raise ValueError("the checkpoint has no vision tower (vision_tower.vision_model.*)")
    tower = load_siglip(config, tensor, prefix)
    mm = ("model." if prefix.startswith("model.") else "") + "multi_modal_projector."
    if has(mm + "mm_input_projection_weight"):  # transformers: [vision, text]
        projection = tensor(mm + "mm_input_projection_weight")
    else:  # a Linear's [out, in] weight
        projection = tensor(mm + "mm_input_projection.weight").t().contiguous()
    tokens = int(raw.get("mm_tokens_per_image") or 256)
    projector = Gemma3Projector(tensor(mm + "mm_soft_emb_norm.weight"), projection,
                                config.eps, config.patches_per_side, tokens)
    names = []
    for key, default in (("boi_token_index", 255_999), ("eoi_token_index", 256_000),
                         ("image_token_index", 262_144)):
        spelled = token_text(int(raw.get(key, default)))
        if not spelled:
            raise ValueError(f"the tokenizer has no token for {key}")
        names.append(spelled)
    return Gemma3Vision(tower, projector, tokens, *names).eval()
