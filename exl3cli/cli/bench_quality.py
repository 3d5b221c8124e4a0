"""`exl3 bench MODEL --ppl FILE [--kl-ref MODEL]`: perplexity over fixed 2048-token
windows of a text, and the mean KL divergence of next-token distributions against a
reference model over the same tokens (exl3cli/convert/quality.py does the arithmetic)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from exl3cli.errors import Exl3Error

WINDOW = 2048


def run_quality(folder: Path, text_path: Path, *, windows: int, reference: Path | None,
                device: str | None, window: int = WINDOW) -> dict[str, Any]:
    """Perplexity of the model in `folder` (and KL / top-1 agreement vs `reference`)."""
    from exl3cli.convert.quality import evaluate, token_windows
    from exl3cli.engine.models.loader import load_causal_lm
    from exl3cli.engine.text.tokenizer import Tokenizer

    try:
        text = Path(text_path).read_text(encoding="utf-8")
    except OSError as error:
        raise Exl3Error(f"cannot read {text_path}: {error.strerror or error}") from None
    ids = Tokenizer.from_folder(folder).encode(text, add_bos=False)
    try:
        token_ids = token_windows(ids, window, windows)
    except ValueError as error:
        raise Exl3Error(str(error)) from None
    target = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    model = load_causal_lm(folder, target)
    ref_model = load_causal_lm(reference, target, torch.float32) if reference else None
    result = evaluate(model, token_ids, ref_model)
    from exl3cli.codec.format import read_quantization_config

    quantization = read_quantization_config(folder) or {}
    bits = quantization.get("bits")  # None for an unquantized model
    report: dict[str, Any] = {"model": str(folder),
                              "bits": bits if isinstance(bits, (int, float)) else None,
                              "text": str(text_path), "windows": int(token_ids.shape[0]),
                              "window": window, "tokens": result.tokens,
                              "perplexity": result.perplexity}
    if ref_model is not None:
        report.update(reference=str(reference), kl=result.kl,
                      top1_agreement=result.top1_agreement)
    return report


def format_quality_report(report: dict[str, Any]) -> str:
    lines = [f"perplexity {report['perplexity']:.4f} over {report['tokens']} tokens "
             f"({report['windows']} windows of {report['window']})"]
    if "kl" in report:
        lines.append(f"KL vs {report['reference']}: {report['kl']:.5f}   "
                     f"top-1 agreement {report['top1_agreement']:.4f}")
    return "\n".join(lines)
