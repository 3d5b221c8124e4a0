"""Gradients through an engine decoder layer on CPU (float32): the fused CPU ops have no
backward, so an input that needs a gradient (the quantizer's sensitivity pass,
convert/sensitivity.py) must take the torch path and get the same gradient as a layer
built without the kernels."""

from __future__ import annotations

import pytest
import torch

from exl3cli.engine.layers.attention import AttentionStep
from exl3cli.engine.layers.linear import DenseLinear
from exl3cli.engine.layers.rope import RotaryEmbedding
from exl3cli.engine.models.decoder_layer import build_decoder_layer
from exl3cli.engine.models.weights import WeightReader
from exl3cli.engine.spec.architecture import get_architecture, load_family_config
from exl3cli.ops import cpu_kernels
from tests.fixtures.tiny_model import write_tiny_model


def _layer(folder, arch: str):
    config = load_family_config(folder)
    spec = get_architecture(config.architecture)
    reader = WeightReader(folder)
    names = spec.tensor_names(reader.has)

    def tensor(name: str) -> torch.Tensor:
        return reader.get(name, dtype=torch.float32)

    def linear(prefixes, _shapes, _bias) -> DenseLinear:
        return DenseLinear(torch.cat([tensor(p + ".weight") for p in prefixes]))

    layer = build_decoder_layer(config, spec, names, 0, spec.layer_types(config)[0],
                                tensor, linear)
    return config, layer


def _step(config, rows: int, cols: int) -> AttentionStep:
    rotary = RotaryEmbedding(config.head_dim, config.rope_theta, config.rope_scaling,
                             config.max_position_embeddings, torch.device("cpu"), torch.float32)
    positions = torch.arange(cols).expand(rows, cols)
    cos, sin = rotary.lookup(positions, cols)
    return AttentionStep(positions=positions, cos=cos.unsqueeze(2), sin=sin.unsqueeze(2),
                         span=cols, start=0)


def _input_gradient(layer, config, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    start = x.clone().requires_grad_(True)
    out = layer(start, _step(config, *x.shape[:2]))
    grad, = torch.autograd.grad((out * weight).sum(), start)
    return grad


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_input_gradient_equals_the_torch_paths(tmp_path, monkeypatch, arch):
    folder = write_tiny_model(tmp_path / arch, arch)
    config, layer = _layer(folder, arch)
    torch.manual_seed(0)
    x = torch.randn(2, 24, config.hidden_size)
    weight = torch.randn(2, 24, config.hidden_size)
    got = _input_gradient(layer, config, x, weight)
    monkeypatch.setattr(cpu_kernels, "available", lambda: False)
    _, plain = _layer(folder, arch)  # built without the kernels: torch ops only
    expected = _input_gradient(plain, config, x, weight)
    # The residual path alone gives `weight`; the check is on what the branches add.
    branch = expected - weight
    assert branch.abs().max() > 1e-3
    assert (got - expected).abs().max() < 1e-5 * max(1.0, float(expected.abs().max()))
