"""Qwen2.5-VL's images: the vision tower and merger (qwen2_5_vl_tower.py) over
dynamic-resolution patches (patch_processor.py), one token per 2 x 2 patches, and the
prompt spelling transformers' Qwen2_5_VLProcessor writes: "<|vision_start|>" +
"<|image_pad|>" once per token + "<|vision_end|>" for each
"<|vision_start|><|image_pad|><|vision_end|>" of the rendered chat (what its chat
template writes for an image). The tokens' grid (rows, columns) gives their M-RoPE
positions (mrope.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from exl3cli.engine.models.vision.patch_processor import PatchImageProcessor
from exl3cli.engine.models.vision.qwen2_5_vl_tower import (
    QwenVisionConfig,
    QwenVisionTower,
    load_qwen_vision_tower,
)

ARCHITECTURE = "Qwen2_5_VLForConditionalGeneration"
# Hub checkpoints (and what transformers 5 saves) keep the tower under "visual.";
# transformers' module names put it under "model.visual.".
_TOWERS = ("visual.", "model.visual.")


def exllamav3_name(name: str) -> str:
    """A tower tensor under the name ExLlamaV3's Qwen2.5-VL reads ("visual.*")."""
    return name.removeprefix("model.") if name.startswith("model.visual.") else name


class Qwen25Vision(nn.Module):
    """(patches, grid) of one image -> its token embeddings [rows * columns, text hidden];
    `placeholder`, `token_grid` and `expand` say how images sit in the prompt."""

    def __init__(self, tower: QwenVisionTower, start: str, end: str, image_token: str):
        super().__init__()
        self.tower = tower
        self.merge = tower.config.merge_size
        self.placeholder = start + image_token + end
        self.start, self.end = start, end
        self.image_token = image_token

    @torch.inference_mode()
    def forward(self, patches: torch.Tensor, grids: Sequence[tuple[int, int, int]]
                ) -> torch.Tensor:
        return self.tower(patches, grids)

    def embed_image(self, pixels: tuple[torch.Tensor, tuple[int, int, int]]) -> torch.Tensor:
        """One image's processor output -> [tokens, text hidden]."""
        patches, grid = pixels
        return self(patches, [grid])

    def token_grid(self, size: tuple[int, int], processor: PatchImageProcessor) -> tuple[int, int]:
        """(rows, columns) of the tokens of an image of `size` (width, height)."""
        rows, cols = processor.grid(*size)
        return rows // self.merge, cols // self.merge

    def expand(self, text: str, grids: Sequence[tuple[int, int]]) -> str:
        """The rendered chat with placeholder i spelled as image i's tokens."""
        pieces = text.split(self.placeholder)
        if len(pieces) != len(grids) + 1:
            raise ValueError(f"{len(pieces) - 1} placeholders for {len(grids)} images")
        out = [pieces[0]]
        for (rows, cols), piece in zip(grids, pieces[1:], strict=True):
            out.append(f"{self.start}{self.image_token * (rows * cols)}{self.end}{piece}")
        return "".join(out)


def load_qwen2_5_vl_vision(raw: dict[str, Any], tensor: Callable[[str], torch.Tensor],
                           has: Callable[[str], bool], token_text: Callable[[int], str | None],
                           ) -> Qwen25Vision:
    """The vision half of a Qwen2.5-VL checkpoint: config.json as `raw`, tensors
    through `tensor(name)` / `has(name)`, token spellings by id."""
    config = QwenVisionConfig.from_dict(raw.get("vision_config") or {})
    prefix = next((p for p in _TOWERS if has(f"{p}patch_embed.proj.weight")), None)
    if prefix is None:
        raise ValueError("the checkpoint has no vision tower (visual.*)")
    tower = load_qwen_vision_tower(config, tensor, prefix)
    names = []
    for key, default in (("vision_start_token_id", 151652), ("vision_end_token_id", 151653),
                         ("image_token_id", 151655)):
        spelled = token_text(int(raw.get(key, default)))
        if not spelled:
            raise ValueError(f"the tokenizer has no token for {key}")
        names.append(spelled)
    return Qwen25Vision(tower, *names).eval()
