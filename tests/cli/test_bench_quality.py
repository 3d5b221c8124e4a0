"""`exl3 bench MODEL --ppl FILE [--kl-ref MODEL]` on tiny real models (CPU)."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from click.testing import CliRunner

from exl3cli.cli import main
from exl3cli.engine.models.loader import load_causal_lm
from exl3cli.engine.text.tokenizer import Tokenizer
from tests.fixtures.tiny_store import write_tiny_chat_model


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("bench-quality")
    first = write_tiny_chat_model(root / "a", max_position_embeddings=2048)
    other = write_tiny_chat_model(root / "b", max_position_embeddings=2048, seed=1)
    text = root / "text.txt"
    text.write_text(" ".join(f"The number {i} follows {i - 1}." for i in range(2500)))
    return first, other, text


def _bench(*args):
    result = CliRunner().invoke(main, ["bench", *args, "--json", "--device", "cpu"])
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


def test_perplexity_equals_a_direct_computation(models):
    first, _, text = models
    report = _bench(str(first), "--ppl", str(text), "--windows", "2")
    ids = Tokenizer.from_folder(first).encode(text.read_text(), add_bos=False)[: 2 * 2048]
    windows = torch.tensor(ids).view(2, 2048)
    with torch.inference_mode():
        logits = load_causal_lm(first, "cpu")(windows)[:, :-1]
    nll = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), windows[:, 1:].reshape(-1))
    assert report["windows"] == 2 and report["tokens"] == 2 * 2047
    assert report["model"] == str(first) and report["bits"] is None  # not quantized
    assert math.isclose(report["perplexity"], math.exp(nll.item()), rel_tol=1e-4)


def test_kl_is_zero_against_itself_and_positive_against_another_model(models):
    first, other, text = models
    same = _bench(str(first), "--ppl", str(text), "--windows", "1", "--kl-ref", str(first))
    assert same["kl"] == pytest.approx(0.0, abs=1e-6) and same["top1_agreement"] == 1.0
    different = _bench(str(first), "--ppl", str(text), "--windows", "1", "--kl-ref", str(other))
    assert different["kl"] > 0.01 and different["top1_agreement"] < 1.0


def test_a_text_shorter_than_one_window_is_a_one_line_error(models, tmp_path):
    first, _, _ = models
    short = tmp_path / "short.txt"
    short.write_text("too short")
    result = CliRunner().invoke(main, ["bench", str(first), "--ppl", str(short)])
    assert result.exit_code == 1
    assert "fewer than one 2048-token window" in result.output
