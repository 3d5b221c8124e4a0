"""EXL3 models without a source checkpoint: plain quantization and synthetic folders.

Public API:
- ``quantize_linear_plain(weight[out, in], k_bits, codebook="mul1", bias=None, seed=0)
  -> dict[suffix, Tensor]``: incoherence transform (random signs + block Hadamard on
  both sides, per-input and per-output RMS scales, one global scale) and the real
  trellis encoder, no Hessian. For tests and quick conversions; the quantizer in
  ``exl3cli/convert`` does the Hessian-aware version.
- ``random_exl3_linear(in_features, out_features, k_bits, codebook="mul1",
  generator=None, device=None) -> dict[suffix, Tensor]``: random trellis words (drawn
  on ``device``, e.g. a GPU, when given), random signs, scales that keep activations
  at unit RMS.
- ``SHAPES``, ``linear_shapes``: see ``synthetic_shapes.py`` (dense Llama shapes and
  the Qwen3-30B-A3B / Mixtral-8x7B mixtures of experts).
- ``write_synthetic_model(out_dir, shape="tiny", bits=4.0, head_bits=6,
  codebook="mul1", tokenizer_from=None, seed=0, shard_bytes=..., num_layers=None,
  device=None, workers=4) -> Path``: an EXL3 folder loadable by any EXL3 reader
  (ExLlamaV3 too: MoE routers stored as 16-bit linears). Fractional ``bits`` mixes
  floor/ceil per layer. Random words come from ``device`` (default: the GPU when there
  is one) and shards are written by ``workers`` threads while the next ones fill.
- ``write_byte_tokenizer(folder, vocab_size)``: a minimal byte-level tokenizer (256
  byte tokens + ``<|begin_of_text|>``, ``<|end_of_text|>``).
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Any

import torch

from exl3cli.codec.format import (
    DEFAULT_SHARD_BYTES,
    Exl3FolderWriter,
    make_quantization_config,
    padded_size,
    write_exl3_linear,
)
from exl3cli.codec.hadamard import block_hadamard
from exl3cli.convert.synthetic_shapes import SHAPES, layer_modules, linear_shapes
from exl3cli.ops.viterbi import encode_tiles

__all__ = ["SHAPES", "copy_tokenizer", "linear_shapes", "quantize_linear_plain",
           "random_exl3_linear", "write_byte_tokenizer", "write_synthetic_model"]

# Global scale of the rotated weight relative to its RMS; the codec's Gaussian sweeps
# (NOTES.md) found the best MSE a little above 1 for K >= 3.
_GLOBAL_SCALE = {1: 1.0, 2: 1.02, 3: 1.04}
_DEFAULT_GLOBAL_SCALE = 1.1


def _random_signs(n: int, generator: torch.Generator) -> torch.Tensor:
    return torch.randint(0, 2, (n,), generator=generator).float() * 2 - 1


def _rms(x: torch.Tensor, dim: int) -> torch.Tensor:
    rms = x.pow(2).mean(dim=dim).sqrt()
    # Zero rows/columns (padding) keep scale 1; fp16 round-trip so decode sees the same.
    return torch.where(rms > 0, rms, torch.ones_like(rms)).clamp(1e-4, 6e4).half().float()


def quantize_linear_plain(
    weight: torch.Tensor,
    k_bits: float,
    codebook: str = "mul1",
    bias: torch.Tensor | None = None,
    seed: int = 0,
) -> dict[str, torch.Tensor]:
    """Quantize a Hugging Face (out, in) weight into EXL3 tensors (by suffix)."""
    out_features, in_features = weight.shape
    pin, pout = padded_size(in_features), padded_size(out_features)
    w = torch.zeros(pin, pout, dtype=torch.float32)
    w[:in_features, :out_features] = weight.detach().float().t()
    gen = torch.Generator().manual_seed(seed)
    su, sv = _random_signs(pin, gen), _random_signs(pout, gen)
    # W = diag(suh) H Ŵ H diag(svh): fold RMS scales into suh/svh, then rotate.
    row_scale = _rms(w, dim=1)
    w = w / row_scale[:, None]
    col_scale = _rms(w, dim=0)
    w = w / col_scale[None, :]
    rotated = block_hadamard(block_hadamard(w * su[:, None] * sv[None, :], dim=0), dim=1)
    factor = _GLOBAL_SCALE.get(int(k_bits), _DEFAULT_GLOBAL_SCALE)
    global_scale = float(rotated.pow(2).mean().sqrt()) * factor or 1.0
    trellis = encode_tiles(rotated / global_scale, k_bits, codebook)
    suh = su * row_scale
    svh = sv * col_scale * global_scale
    tensors = write_exl3_linear("x", trellis, suh, svh, codebook, bias)
    return {name.removeprefix("x."): value for name, value in tensors.items()}


def random_exl3_linear(
    in_features: int,
    out_features: int,
    k_bits: float,
    codebook: str = "mul1",
    generator: torch.Generator | None = None,
    device: torch.device | str | None = None,
) -> dict[str, torch.Tensor]:
    """Random trellis words and signs; y = x W keeps roughly the RMS of x. With
    ``device`` (e.g. "cuda") the words are drawn there (a different stream of numbers
    than the CPU generator's) and copied back."""
    gen = generator or torch.Generator().manual_seed(0)
    pin, pout = padded_size(in_features), padded_size(out_features)
    words = int(16 * k_bits)
    shape = (pin // 16, pout // 16, words)
    if device is None or torch.device(device).type == "cpu":
        trellis = torch.randint(-(2**15), 2**15, shape, generator=gen,
                                dtype=torch.int32).to(torch.int16)
    else:
        trellis = torch.randint(-(2**15), 2**15, shape, dtype=torch.int16,
                                device=device).cpu()
    suh = _random_signs(pin, gen)
    svh = _random_signs(pout, gen) / math.sqrt(in_features)
    tensors = write_exl3_linear("x", trellis, suh, svh, codebook)
    return {name.removeprefix("x."): value for name, value in tensors.items()}


def _layer_bits(bits: float, index: int, count: int) -> int:
    """Integer K per layer so that the average over ``count`` layers is ``bits``."""
    low = math.floor(bits)
    promoted = round((bits - low) * count)
    return low + (1 if index < promoted else 0)


def _random_device(device: torch.device | str | None) -> torch.device:
    if device is not None:
        return torch.device(device)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def write_synthetic_model(
    out_dir: str | Path,
    shape: str = "tiny",
    bits: float = 4.0,
    head_bits: int = 6,
    codebook: str = "mul1",
    tokenizer_from: str | Path | None = None,
    seed: int = 0,
    shard_bytes: int = DEFAULT_SHARD_BYTES,
    num_layers: int | None = None,
    device: torch.device | str | None = None,
    workers: int = 4,
) -> Path:
    """Write an EXL3 folder of architecture ``shape`` with random quantized weights.

    ``num_layers`` overrides the depth (every other size stays the real one)."""
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; choose from {sorted(SHAPES)}")
    if not 1 <= bits <= 8 or not 1 <= head_bits <= 8:
        raise ValueError("bits and head_bits must lie in 1..8")
    config = dict(SHAPES[shape])
    if num_layers is not None:
        config["num_hidden_layers"] = int(num_layers)
    gen = torch.Generator().manual_seed(seed)
    where = _random_device(device)
    if where.type == "cuda":
        torch.cuda.manual_seed(seed)
    writer = Exl3FolderWriter(out_dir, config, shard_bytes, workers=workers)
    hidden, vocab = config["hidden_size"], config["vocab_size"]
    dtype = getattr(torch, config["torch_dtype"])
    if where.type == "cuda":
        embed = torch.randn(vocab, hidden, device=where).to(dtype).cpu()
    else:
        embed = torch.randn(vocab, hidden, generator=gen).to(dtype)
    writer.add_tensor("model.embed_tokens.weight", embed)
    layers = config["num_hidden_layers"]
    for layer in range(layers):
        k = _layer_bits(bits, layer, layers)
        for module in layer_modules(config, layer):
            if module.kind == "norm":
                writer.add_tensor(module.name, torch.ones(module.in_features, dtype=dtype))
            elif module.kind == "dense":  # a router: logits of roughly unit scale
                weight = torch.randn(module.out_features, module.in_features, generator=gen)
                writer.add_dense_linear(module.name, weight / math.sqrt(module.in_features))
            else:
                writer.add_linear_tensors(module.name, random_exl3_linear(
                    module.in_features, module.out_features, k, codebook, gen, where))
    writer.add_tensor("model.norm.weight", torch.ones(hidden, dtype=dtype))
    writer.add_linear_tensors("lm_head", random_exl3_linear(hidden, vocab, head_bits,
                                                            codebook, gen, where))
    out = writer.close(make_quantization_config(bits, head_bits, codebook, synthetic=True))
    _write_generation_config(out, config)
    if tokenizer_from is not None:
        copy_tokenizer(tokenizer_from, out)
    else:
        write_byte_tokenizer(out, vocab)
    return out


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "tokenizer.model", "vocab.json", "merges.txt", "chat_template.jinja",
                   "generation_config.json")


def copy_tokenizer(source: str | Path, out_dir: str | Path) -> list[str]:
    """Copy the tokenizer files present in ``source``; returns the names copied."""
    copied = []
    for name in TOKENIZER_FILES:
        path = Path(source) / name
        if path.is_file():
            shutil.copyfile(path, Path(out_dir) / name)
            copied.append(name)
    if "tokenizer.json" not in copied and "tokenizer.model" not in copied:
        raise FileNotFoundError(f"no tokenizer.json or tokenizer.model in {source}")
    return copied


def _write_generation_config(out_dir: Path, config: dict[str, Any]) -> None:
    data = {"bos_token_id": config.get("bos_token_id"), "eos_token_id": config.get("eos_token_id")}
    (out_dir / "generation_config.json").write_text(json.dumps(data, indent=2) + "\n")


def write_byte_tokenizer(folder: str | Path, vocab_size: int) -> Path:
    """A byte-level BPE without merges: ids 0..255 are bytes, 256/257 are BOS/EOS."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    if vocab_size < 258:
        raise ValueError("a byte-level tokenizer needs a vocabulary of at least 258")
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet(), key=_byte_of_char)
    tokenizer = Tokenizer(models.BPE({c: i for i, c in enumerate(alphabet)}, []))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    bos, eos = "<|begin_of_text|>", "<|end_of_text|>"
    tokenizer.add_special_tokens([AddedToken(bos, special=True), AddedToken(eos, special=True)])
    folder = Path(folder)
    tokenizer.save(str(folder / "tokenizer.json"))
    tok_config = {"bos_token": bos, "eos_token": eos, "add_bos_token": True,
                  "model_max_length": 2048, "tokenizer_class": "PreTrainedTokenizerFast"}
    (folder / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2) + "\n")
    return folder


def _byte_of_char(char: str) -> int:
    """Inverse of the GPT-2 byte -> printable character map (orders the alphabet)."""
    code = ord(char)
    printable = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    if code in printable:
        return code
    others = [b for b in range(256) if b not in printable]
    return others[code - 256]
