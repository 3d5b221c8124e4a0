"""Layer split: whole layers per device in turn, sized from each device's budget. On
the CPU "cpu" stands for every device, so each later stage runs on its own page pool
(the mirrored step) exactly as it would on another GPU; the greedy tokens and logits
are the one-device model's, through the generator, for a dense and a MoE family."""

from __future__ import annotations

import pytest
import torch

from exl3cli.engine.models.layer_split import load_layer_split, parse_gpu_split, plan_layer_split
from exl3cli.engine.models.loader import load_causal_lm
from exl3cli.engine.models.placement import MemoryEstimate
from exl3cli.errors import InvalidOption, ModelLoadError
from tests.engine.parallel.conftest import greedy_texts
from tests.fixtures.tiny_exl3 import random_exl3_folder
from tests.fixtures.tiny_store import write_tiny_chat_model

IDS = torch.tensor([[5, 6, 7, 8, 9, 10]])


def test_plan_fills_each_device_in_turn():
    estimate = MemoryEstimate(layers=(100,) * 6, other=300, cache_per_layer=10, workspace=50)
    # device 0: 50 + 300 + 2 * 110 = 570 <= 600; device 1: 50 + 4 * 110 = 490 <= 500
    assert plan_layer_split(estimate, [600, 500]) == [2, 4]
    assert plan_layer_split(estimate, [2000, 500]) == [6, 0]
    with pytest.raises(ModelLoadError, match="2 of 6 layers do not fit"):
        plan_layer_split(estimate, [600, 300])


def test_gpu_split_values():
    assert parse_gpu_split("20, 24") == [20.0, 24.0]
    assert parse_gpu_split("auto") is None and parse_gpu_split(None) is None
    with pytest.raises(InvalidOption, match="gpu_split must be 'auto' or GiB"):
        parse_gpu_split("lots")


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
@pytest.mark.parametrize("decode_mode", ["off", "static"])
def test_split_matches_one_device(tmp_path, arch, decode_mode):
    folder = write_tiny_chat_model(tmp_path / arch, arch, num_hidden_layers=3)
    single = load_causal_lm(folder, device="cpu")
    split = load_layer_split(folder, ["cpu", "cpu"], counts=[1, 2])
    assert split.layer_split == [1, 2]
    torch.testing.assert_close(split(IDS), single(IDS), rtol=1e-5, atol=1e-5)
    assert (greedy_texts(split, folder, decode_mode=decode_mode)
            == greedy_texts(single, folder, decode_mode=decode_mode))


def test_split_sized_from_budgets_with_exl3(tmp_path):
    src = write_tiny_chat_model(tmp_path / "src", "llama", num_hidden_layers=3)
    folder = random_exl3_folder(src, tmp_path / "exl3")
    single = load_causal_lm(folder, device="cpu")
    split = load_layer_split(folder, ["cpu", "cpu"], "0.0006,1", num_ctx=64)
    assert split.layer_split[1] >= 1 and sum(split.layer_split) == 3
    assert greedy_texts(split, folder) == greedy_texts(single, folder)


def test_split_that_does_not_fit_is_refused(tmp_path):
    folder = write_tiny_chat_model(tmp_path / "llama", "llama")
    with pytest.raises(ModelLoadError, match="layer split: the model needs"):
        load_layer_split(folder, ["cpu", "cpu"], [0.0001, 0.0001])
