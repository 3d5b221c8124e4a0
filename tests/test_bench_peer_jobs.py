"""bench/peer_jobs.py: the peer's prompts stay inside the folder's vocabulary (a
32,000-token Mixtral refused the shared script's ids up to 40,000 with an IndexError)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "peer_jobs.py"


def _module():
    spec = importlib.util.spec_from_file_location("peer_jobs", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("vocab", [32_000, 128_256, 151_936, 300])
def test_prompt_ids_fall_inside_the_vocabulary(vocab):
    low, high = _module().prompt_range(vocab)
    assert 0 <= low < high <= vocab


def test_vocab_size_reads_plain_and_text_configs(tmp_path):
    peer = _module()
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 32_000}))
    assert peer.vocab_size(tmp_path) == 32_000
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"vocab_size": 262_208}}))
    assert peer.vocab_size(tmp_path) == 262_208
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 8}))
    with pytest.raises(SystemExit, match="no vocab_size"):
        peer.vocab_size(tmp_path)
