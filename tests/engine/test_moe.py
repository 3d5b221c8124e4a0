"""The mixture-of-experts block (engine/layers/moe.py) and MoE folders.

Prompt + greedy-decode logits of Mixtral, Qwen2-MoE and Qwen3-MoE against transformers
live with the other families in test_model_vs_transformers.py. Here: the grouped
dispatch equals a token-by-token loop, the routers equal transformers' own (softmax,
DeepSeek's grouped sigmoid, gpt-oss's top-k softmax), expert token counts, and EXL3
folders with experts named as ExLlamaV3 stores them.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers

from exl3cli.codec.format import Exl3FolderWriter, make_quantization_config
from exl3cli.convert.synthetic import quantize_linear_plain
from exl3cli.engine.layers.fused_experts import split_fused_experts
from exl3cli.engine.layers.linear import DenseLinear, Exl3Linear, FusedLinear
from exl3cli.engine.layers.mlp import GatedMLP
from exl3cli.engine.layers.moe import MoEMLP, Router
from exl3cli.engine.models.loader import load_causal_lm
from exl3cli.engine.models.weights import WeightReader
from exl3cli.engine.spec.architecture import get_architecture, load_family_config
from exl3cli.errors import ModelLoadError
from tests.fixtures.tiny_model import tiny_reference_model, write_tiny_model

HIDDEN, WIDTH, EXPERTS = 32, 24, 6


def _dense(out_features: int, in_features: int, gen: torch.Generator,
           bias: bool = False) -> DenseLinear:
    weight = torch.randn(out_features, in_features, generator=gen) * 0.3
    return DenseLinear(weight, torch.randn(out_features, generator=gen) if bias else None)


def _expert(gen: torch.Generator, width: int = WIDTH) -> GatedMLP:
    return GatedMLP(_dense(2 * width, HIDDEN, gen), _dense(HIDDEN, width, gen), "silu")


def _block(top_k: int = 2, shared: bool = True, **router) -> MoEMLP:
    gen = torch.Generator().manual_seed(0)
    return MoEMLP(
        Router(_dense(EXPERTS, HIDDEN, gen), top_k, **router),
        [_expert(gen) for _ in range(EXPERTS)],
        _expert(gen, 40) if shared else None, _dense(1, HIDDEN, gen) if shared else None,
    )


def _token_by_token(block: MoEMLP, x: torch.Tensor) -> torch.Tensor:
    """The definition: each token, each of its chosen experts, weighted and summed."""
    rows = x.reshape(-1, HIDDEN)
    out = torch.zeros_like(rows)
    weights, chosen = block.router(rows)
    for t in range(rows.shape[0]):
        for w, e in zip(weights[t].tolist(), chosen[t].tolist(), strict=True):
            out[t] += w * block.experts[e](rows[t : t + 1])[0]
        if block.shared is not None:
            out[t] += block.shared(rows[t : t + 1])[0] * torch.sigmoid(
                block.shared_gate(rows[t : t + 1]))[0]
    return out.view(x.shape)


@pytest.mark.parametrize("top_k, shared", [(1, False), (2, True), (3, False)])
def test_grouped_dispatch_matches_a_token_by_token_loop(top_k, shared):
    block = _block(top_k, shared)
    x = torch.randn(3, 7, HIDDEN, generator=torch.Generator().manual_seed(1))
    got = block(x)
    assert got.shape == x.shape
    assert (got - _token_by_token(block, x)).abs().max() < 1e-5
    # Every (token, expert) pair is counted once; all experts got some of 21 tokens.
    assert sum(block.last_counts) == 21 * top_k and len(block.last_counts) == EXPERTS


def test_an_expert_without_tokens_is_skipped():
    block = _block(1, shared=False)
    # Route everything to expert 4: its router row dominates.
    block.router.gate.weight.zero_()
    block.router.gate.weight[4] = 1.0
    x = torch.rand(2, 5, HIDDEN, generator=torch.Generator().manual_seed(2)) + 0.1
    out = block(x)
    assert block.last_counts == [0, 0, 0, 0, 10, 0]
    assert (out - block.experts[4](x)).abs().max() < 1e-5


def _router_config(cls: type, **extra):
    return cls(hidden_size=HIDDEN, num_local_experts=8, num_experts_per_tok=3, **extra)


def test_grouped_sigmoid_router_matches_deepseek_v3():
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    gen = torch.Generator().manual_seed(3)
    config = _router_config(transformers.DeepseekV3Config, n_group=4, topk_group=2,
                            routed_scaling_factor=2.5, norm_topk_prob=True)
    reference = DeepseekV3TopkRouter(config)
    with torch.no_grad():
        reference.weight.copy_(torch.randn(8, HIDDEN, generator=gen))
        reference.e_score_correction_bias.copy_(torch.randn(8, generator=gen) * 0.5)
    ours = Router(DenseLinear(reference.weight.detach()), 3, "sigmoid", True,
                  reference.e_score_correction_bias, n_group=4, topk_group=2, scale=2.5)
    rows = torch.randn(50, HIDDEN, generator=gen)
    _, ref_weights, ref_chosen = reference(rows)
    weights, chosen = ours(rows)
    # Same experts per token (order within a token may differ), same weights.
    ref_order, our_order = ref_chosen.argsort(-1), chosen.argsort(-1)
    assert torch.equal(ref_chosen.gather(-1, ref_order), chosen.gather(-1, our_order))
    assert torch.allclose(ref_weights.gather(-1, ref_order), weights.gather(-1, our_order),
                          atol=1e-6)
    # Grouping matters: without it some tokens pick experts from a losing group.
    ungrouped = Router(DenseLinear(reference.weight.detach()), 3, "sigmoid", True,
                       reference.e_score_correction_bias, scale=2.5)
    assert not torch.equal(ungrouped(rows)[1].sort(-1).values, chosen.sort(-1).values)


def test_topk_softmax_router_matches_gpt_oss():
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssTopKRouter

    gen = torch.Generator().manual_seed(4)
    reference = GptOssTopKRouter(_router_config(transformers.GptOssConfig))
    with torch.no_grad():
        reference.weight.copy_(torch.randn(8, HIDDEN, generator=gen))
        reference.bias.copy_(torch.randn(8, generator=gen))
    ours = Router(DenseLinear(reference.weight.detach(), reference.bias.detach()), 3,
                  "topk_softmax")
    rows = torch.randn(40, HIDDEN, generator=gen)
    _, ref_weights, ref_chosen = reference(rows)
    weights, chosen = ours(rows)
    assert torch.equal(ref_chosen, chosen)
    assert torch.allclose(ref_weights, weights, atol=1e-6)


def test_router_refuses_impossible_settings():
    gate = DenseLinear(torch.zeros(8, HIDDEN))
    with pytest.raises(ModelLoadError, match="num_experts_per_tok 9"):
        Router(gate, 9)
    with pytest.raises(ModelLoadError, match="groups"):
        Router(gate, 2, "sigmoid", n_group=3)


def test_moe_config_without_expert_count_is_a_clear_error(tmp_path):
    folder = write_tiny_model(tmp_path, "qwen3_moe", num_hidden_layers=1)
    config = json.loads((folder / "config.json").read_text())
    for key in ("num_experts", "num_local_experts"):
        config.pop(key, None)
    config["decoder_sparse_step"] = 1
    config["mlp_only_layers"] = []
    (folder / "config.json").write_text(json.dumps(config))
    # Without experts every layer is dense: its dense MLP tensors are not there.
    with pytest.raises(ModelLoadError, match="mlp.gate_proj"):
        load_causal_lm(folder, device="cpu")


# --- EXL3 folders -------------------------------------------------------------------

_LINEAR_SUFFIXES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                    "down_proj", "w1", "w2", "w3", "q_a_proj", "q_b_proj",
                    "kv_a_proj_with_mqa", "kv_b_proj")


def _quantize_folder(src: Path, out: Path, k_bits: int, dense: tuple[str, ...] = ()) -> Path:
    """Every projection and expert through the real trellis encoder under its own name
    (experts.{e}.gate_proj / w1 ...; gpt-oss's fused experts split as ExLlamaV3 writes
    them), but those named in `dense`; router, norms, sinks, embeddings kept as they are."""
    config = load_family_config(src)
    reader = split_fused_experts(WeightReader(src), config, get_architecture(config.architecture))
    writer = Exl3FolderWriter(out, json.loads((src / "config.json").read_text()), 2**40)
    for key in reader.keys():
        module, kind = key.rsplit(".", 1)
        short = module.rsplit(".", 1)[-1]
        if module == "lm_head" or (short in _LINEAR_SUFFIXES and short not in dense):
            if kind == "weight":
                bias = reader.get(module + ".bias") if reader.has(module + ".bias") else None
                writer.add_linear_tensors(module, quantize_linear_plain(
                    reader.get(key), k_bits, "mul1", bias, seed=len(module)))
        else:
            writer.add_tensor(key, reader.get(key))
    writer.close(make_quantization_config(k_bits, k_bits, "mul1"))
    return out


@pytest.mark.parametrize("arch, expert", [
    ("qwen3_moe", "model.layers.0.mlp.experts.3.gate_proj"),
    ("mixtral", "model.layers.0.block_sparse_moe.experts.3.w1"),
    ("qwen2_moe", "model.layers.0.mlp.shared_expert.down_proj"),
    # Interleaved rope: q and k of the trellis layers are reordered by a gather.
    ("ernie4_5_moe", "model.layers.0.mlp.shared_experts.up_proj"),
    # Attention sinks; experts split out of the fused tensors, with biases.
    ("gpt_oss", "model.layers.0.mlp.experts.3.gate_proj"),
    # Multi-head latent attention: its projections quantized under their own names.
    ("deepseek_v3", "model.layers.0.self_attn.kv_b_proj"),
])
def test_exl3_moe_folder_loads_and_tracks_the_original(tmp_path, arch, expert):
    overrides = {"num_hidden_layers": 1, "vocab_size": 128}
    if arch == "ernie4_5_moe":
        overrides["moe_layer_start_index"] = 0
    if arch == "deepseek_v3":
        overrides["first_k_dense_replace"] = 0
    folder = _quantize_folder(write_tiny_model(tmp_path / "src", arch, **overrides),
                              tmp_path / "exl3", k_bits=7)
    assert WeightReader(folder).has(expert + ".trellis")
    model = load_causal_lm(folder, device="cpu")
    ids = torch.randint(0, 128, (2, 20), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        expected = tiny_reference_model(arch, **overrides)(ids).logits.float()
    got = model(ids)
    corr = torch.corrcoef(torch.stack([got.flatten(), expected.flatten()]))[0, 1].item()
    assert corr > 0.99
    trellis = load_causal_lm(folder, device="cpu", linear_mode="trellis")
    moe = trellis.layers[0].mlp
    assert isinstance(moe, MoEMLP)
    assert isinstance(moe.experts[0].down, Exl3Linear)
    assert isinstance(moe.experts[0].gate_up, FusedLinear)  # gate and up side by side
    assert (trellis(ids) - got).abs().max() < 1e-2


def test_exl3_deepseek_folder_as_exllamav3_writes_it_loads(tmp_path):
    """ExLlamaV3 1.6.5 quantizes q_a / q_b / kv_a / o_proj and keeps kv_b_proj dense (its
    MLA reads kv_b_proj.weight): such a folder loads and tracks the original."""
    overrides = {"num_hidden_layers": 1, "vocab_size": 128, "first_k_dense_replace": 0}
    folder = _quantize_folder(write_tiny_model(tmp_path / "src", "deepseek_v3", **overrides),
                              tmp_path / "exl3", k_bits=7, dense=("kv_b_proj",))
    reader = WeightReader(folder)
    attn = "model.layers.0.self_attn."
    assert reader.has(attn + "kv_b_proj.weight") and not reader.has(attn + "kv_b_proj.trellis")
    assert reader.has(attn + "q_b_proj.trellis")
    ids = torch.randint(0, 128, (2, 20), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        expected = tiny_reference_model("deepseek_v3", **overrides)(ids).logits.float()
    got = load_causal_lm(folder, device="cpu")(ids)
    assert torch.corrcoef(torch.stack([got.flatten(), expected.flatten()]))[0, 1] > 0.99


# --- the sync-free decode path (engine/layers/moe_decode.py) --------------------------------


def _clamped_block_with_biases() -> MoEMLP:
    """gpt-oss's kind: biases on every expert projection, the clamped SwiGLU."""
    gen = torch.Generator().manual_seed(3)
    experts = [GatedMLP(_dense(2 * WIDTH, HIDDEN, gen, bias=True),
                        _dense(HIDDEN, WIDTH, gen, bias=True), "swiglu_clamped", limit=1.0)
               for _ in range(EXPERTS)]
    return MoEMLP(Router(_dense(EXPERTS, HIDDEN, gen, bias=True), 2, "topk_softmax"), experts)


@pytest.mark.parametrize("make", [lambda: _block(2, shared=True),
                                  lambda: _block(3, shared=False, scoring="sigmoid",
                                                 n_group=2, topk_group=1, scale=2.5),
                                  _clamped_block_with_biases])
def test_the_sync_free_path_matches_the_grouped_dispatch(make):
    block = make()
    x = torch.randn(5, 1, HIDDEN, generator=torch.Generator().manual_seed(4))  # 5 decode rows
    grouped = block(x)
    assert block.stack_experts()
    block.last_counts = []
    stacked = block(x)
    assert block.last_counts == []  # it did not go through the grouped dispatch
    assert (stacked - grouped).abs().max() < 1e-5
    # Prefill-sized calls keep the grouped dispatch.
    long = torch.randn(1, 40, HIDDEN, generator=torch.Generator().manual_seed(6))
    block(long)
    assert sum(block.last_counts) == 40 * block.router.top_k


def test_the_sync_free_path_reads_nothing_back():
    """On the meta device every value is unknown: an op that needs one on the host
    (tolist, item, nonzero, a bincount sized by the data) fails there."""
    block = _block(2, shared=True)
    assert block.stack_experts()
    block = block.to("meta")
    x = torch.empty(4, 1, HIDDEN, device="meta")
    assert block(x).shape == x.shape
    block.stacked = None  # the grouped dispatch does read counts back
    with pytest.raises((NotImplementedError, RuntimeError)):
        block(x)


@pytest.mark.cuda
def test_the_sync_free_path_is_captured_by_a_cuda_graph():
    block = _block(2, shared=True).cuda()
    assert block.stack_experts()
    x = torch.randn(8, 1, HIDDEN, device="cuda")
    expected = block(x)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up outside the graph
        block(x)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = block(x)
    fresh = torch.randn(8, 1, HIDDEN, device="cuda")
    x.copy_(fresh)
    graph.replay()
    torch.cuda.synchronize()
    assert (out - block(fresh)).abs().max() < 1e-4
    assert (out - expected).abs().max() > 0  # the replay computed the new rows


@pytest.mark.parametrize("top_k, width", [(2, 24), (3, 130)])  # 130: padded to 256
def test_the_moe_kernels_twin_matches_the_grouped_dispatch(top_k, width):
    """exl3cli/ops/moe_kernels.py's PyTorch twin (the CUDA kernels' steps and roundings)
    on CPU EXL3 experts in trellis mode, against MoEMLP's grouped dispatch."""
    from exl3cli.convert.synthetic import random_exl3_linear
    from exl3cli.ops import moe_kernels

    gen = torch.Generator().manual_seed(7)

    def exl3(i: int, o: int) -> Exl3Linear:
        return Exl3Linear(random_exl3_linear(i, o, 4, "mul1", gen), i, o, mode="trellis")

    experts = [GatedMLP(FusedLinear([exl3(HIDDEN, width), exl3(HIDDEN, width)]),
                        exl3(width, HIDDEN), "silu") for _ in range(EXPERTS)]
    block = MoEMLP(Router(_dense(EXPERTS, HIDDEN, gen), top_k), experts)
    tables = moe_kernels.ExpertTables.build(
        [e.gate_up.parts[0] for e in experts], [e.gate_up.parts[1] for e in experts],
        [e.down for e in experts], "silu", HIDDEN)
    assert tables is not None and not moe_kernels.runs_on_kernels(torch.zeros(1, HIDDEN), tables)
    x = torch.randn(5, HIDDEN, generator=gen)
    weights, chosen = block.router(x)
    want = block._routed(x, weights, chosen)
    got = moe_kernels.moe_experts(x, weights, chosen, tables)
    assert (got - want).abs().max() < 1e-2 * want.abs().max()  # xh rounded to float16
    bias = [e.down for e in experts]
    bias[0].bias = torch.zeros(HIDDEN)
    assert moe_kernels.ExpertTables.build(  # biases: not for the kernels
        [e.gate_up.parts[0] for e in experts], [e.gate_up.parts[1] for e in experts],
        bias, "silu", HIDDEN) is None


def test_mxfp4_gpt_oss_experts_are_refused_in_one_line(tmp_path):
    from safetensors.torch import load_file, save_file

    from exl3cli.errors import UnsupportedArchitecture

    folder = write_tiny_model(tmp_path / "src", "gpt_oss", num_hidden_layers=2)
    tensors = load_file(str(folder / "model.safetensors"))
    for key in [k for k in tensors if k.endswith("experts.gate_up_proj")]:
        tensors[key + "_blocks"] = tensors.pop(key).to(torch.uint8)  # as OpenAI ships them
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(UnsupportedArchitecture, match="MXFP4") as info:
        load_causal_lm(folder, device="cpu")
    assert "\n" not in str(info.value)


def test_ernie_choice_bias_under_exllamav3s_name_loads(tmp_path):
    """ERNIE 4.5 MoE checkpoints keep the choice bias in mlp.moe_statics; ExLlamaV3
    (and exl3 convert) write it next to the router weight, mlp.gate: both load, and a
    folder with neither is refused in one line."""
    from safetensors.torch import load_file, save_file

    overrides = {"num_hidden_layers": 1, "moe_layer_start_index": 0}
    folder = write_tiny_model(tmp_path, "ernie4_5_moe", **overrides)
    ours, peers = ("model.layers.0.mlp.moe_statics.e_score_correction_bias",
                   "model.layers.0.mlp.gate.e_score_correction_bias")
    tensors = load_file(folder / "model.safetensors")
    assert tensors[ours].abs().max() > 0  # the bias changes the choice of experts
    ids = torch.randint(3, 300, (1, 24), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        expected = tiny_reference_model("ernie4_5_moe", **overrides)(ids).logits.float()
    save_file({(peers if k == ours else k): v for k, v in tensors.items()},
              folder / "model.safetensors", metadata={"format": "pt"})
    assert (load_causal_lm(folder, device="cpu")(ids) - expected).abs().max() < 1e-3
    save_file({k: v for k, v in tensors.items() if k != ours}, folder / "model.safetensors",
              metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match="choice bias is missing: neither"):
        load_causal_lm(folder, device="cpu")
