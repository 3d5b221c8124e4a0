"""Images in, text out: vision towers, their image preprocessing, and the image tokens
they place in a language model's prompt.

- `image_processor.py`: bytes -> Pillow image -> normalised pixel tensor (transformers'
  processors, step for step).
- `patch_processor.py`: dynamic-resolution patches (Qwen2-VL's smart_resize to multiples
  of 28 pixels, flattened merge-block by merge-block) and their grid.
- `siglip.py`: the SigLIP vision encoder (patch embedding, encoder, post-layernorm).
- `qwen2_5_vl_tower.py`: Qwen2.5-VL's vision transformer (2-D rotary, window attention
  with full-attention blocks, SwiGLU) and patch merger (2 x 2 patches -> one token).
- `qwen2_5_vl.py`: Qwen2.5-VL's prompt spelling (vision start, one pad per token,
  vision end) and tower loading.
- `mrope.py`: M-RoPE positions (temporal, height, width) of prompts with images.
- `gemma3.py`: Gemma 3's projector (pool to 256 tokens, soft-embedding norm,
  projection) and how its image tokens are spelled in the prompt.
- `image_tokens.py`: encoded images as token ids past the vocabulary (so the paged cache
  and prefix reuse treat them like text), their embeddings, and the bidirectional
  attention over each image's tokens.
- `loader.py`: the vision model of a folder, or None for a text-only one.
"""
