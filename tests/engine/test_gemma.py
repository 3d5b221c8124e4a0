"""Gemma 2 and Gemma 3 (text) on every engine path, against transformers.

The prompt + greedy-decode comparison for both families lives with the other families
in test_model_vs_transformers.py. Here: each Gemma feature is shown to matter (drop it
from config.json and the logits leave transformers'), 4.x-style config.json keys, the
paged generator step, the fixed-shape decode step, bfloat16, the CPU fast paths that
must not run, and EXL3 folders (real trellis encoder) of tiny Gemma models.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers

from exl3cli.codec.format import Exl3FolderWriter, make_quantization_config
from exl3cli.convert.synthetic import quantize_linear_plain
from exl3cli.engine.generation.decode_step import DecodeRunner
from exl3cli.engine.kvcache.kv_quant import KVCacheType
from exl3cli.engine.kvcache.paged_attention import PagedBatch
from exl3cli.engine.kvcache.paged_cache import PagePool, PageTable
from exl3cli.engine.layers.linear import Exl3Linear
from exl3cli.engine.models.loader import load_causal_lm
from exl3cli.engine.models.weights import WeightReader
from exl3cli.engine.spec.architecture import (
    FULL_ATTENTION,
    SLIDING_ATTENTION,
    get_architecture,
    load_family_config,
)
from exl3cli.engine.spec.config import ModelConfig
from tests.fixtures.paged import PagedSequences
from tests.fixtures.tiny_model import tiny_reference_model, write_tiny_model

TOLERANCE = 1e-3
# Caps small enough that the tiny models' scores and logits reach them.
GEMMA2_CAPS = {"attn_logit_softcapping": 3.0, "final_logit_softcapping": 5.0}
CASES = {"gemma2": ("gemma2", GEMMA2_CAPS), "gemma3": ("gemma3", {})}


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gemma")
    return {case: write_tiny_model(root / case, arch, **overrides)
            for case, (arch, overrides) in CASES.items()}


def _ids(length: int, seed: int, batch: int = 1) -> torch.Tensor:
    return torch.randint(3, 300, (batch, length), generator=torch.Generator().manual_seed(seed))


def _reference(case: str, ids: torch.Tensor) -> torch.Tensor:
    arch, overrides = CASES[case]
    with torch.no_grad():
        return tiny_reference_model(arch, **overrides)(ids).logits.float()


def _edited_copy(folder: Path, out: Path, **changes) -> Path:
    """A copy of `folder` whose config.json has `changes` applied (None deletes a key)."""
    out.mkdir()
    for item in folder.iterdir():
        (out / item.name).symlink_to(item)
    config = json.loads((folder / "config.json").read_text())
    for key, value in changes.items():
        config.pop(key, None)
        if value is not None:
            config[key] = value
    (out / "config.json").unlink()
    (out / "config.json").write_text(json.dumps(config))
    return out


FEATURE_EDITS = {
    "gemma2_attention_softcap": ("gemma2", {"attn_logit_softcapping": None}),
    "gemma2_final_softcap": ("gemma2", {"final_logit_softcapping": None}),
    "gemma2_attention_scale": ("gemma2", {"query_pre_attn_scalar": None}),
    "gemma2_sliding_window": ("gemma2", {"sliding_window": None}),
    "gemma3_attention_scale": ("gemma3", {"query_pre_attn_scalar": None}),
    "gemma3_sliding_rope": (
        "gemma3",
        {"rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}},
    ),
}


@pytest.mark.parametrize("edit", sorted(FEATURE_EDITS))
def test_each_feature_changes_the_logits(folders, tmp_path, edit):
    """Guards the transformers comparisons against testing nothing: a model that
    ignores one feature is far from the reference, the full one is on it."""
    case, changes = FEATURE_EDITS[edit]
    ids = _ids(24, seed=11)
    expected = _reference(case, ids)
    assert (load_causal_lm(folders[case], "cpu")(ids) - expected).abs().max() < TOLERANCE
    crippled = load_causal_lm(_edited_copy(folders[case], tmp_path / "edited", **changes), "cpu")
    assert (crippled(ids) - expected).abs().max() > 1e-2


def test_transformers_4_style_gemma3_config(folders, tmp_path):
    """rope_theta / rope_local_base_freq / sliding_window_pattern at the top level and
    no layer_types, as Gemma 3 checkpoints on the hub write them."""
    legacy = _edited_copy(
        folders["gemma3"], tmp_path / "legacy", rope_parameters=None, layer_types=None,
        rope_theta=1000000.0, rope_local_base_freq=10000.0, sliding_window_pattern=3,
        _sliding_window_pattern=None,
    )
    config = load_family_config(legacy)
    assert (config.rope_theta, config.sliding_rope_theta) == (1000000.0, 10000.0)
    # 3 layers with pattern 3: two sliding, the third global (what the fixture wrote).
    assert get_architecture("Gemma3ForCausalLM").layer_types(config) == [
        SLIDING_ATTENTION, SLIDING_ATTENTION, FULL_ATTENTION]
    ids = _ids(20, seed=12)
    assert (load_causal_lm(legacy, "cpu")(ids) - _reference("gemma3", ids)).abs().max() < TOLERANCE


def test_config_parsing_of_gemma_keys():
    base = {"hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4,
            "vocab_size": 10, "head_dim": 32, "sliding_window": 8}
    gemma2 = ModelConfig.from_dict({
        **base, "architectures": ["Gemma2ForCausalLM"], "hidden_act": "gelu",
        "hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": 224,
        "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0,
    })
    assert gemma2.hidden_act == "gelu_pytorch_tanh"  # hidden_activation wins
    assert (gemma2.query_pre_attn_scalar, gemma2.attn_logit_softcapping,
            gemma2.final_logit_softcapping) == (224.0, 50.0, 30.0)
    assert gemma2.sliding_rope_theta is None
    # Gemma 2 without layer_types: layer 0 slides, then every other layer.
    assert get_architecture("Gemma2ForCausalLM").layer_types(gemma2) == [
        SLIDING_ATTENTION, FULL_ATTENTION, SLIDING_ATTENTION, FULL_ATTENTION]
    gemma3 = ModelConfig.from_dict({
        **base, "architectures": ["Gemma3ForCausalLM"], "rope_theta": 1e6,
        "rope_scaling": {"rope_type": "linear", "factor": 8.0}, "rope_local_base_freq": 1e4,
    })
    # 4.x: rope_scaling is the global layers'; sliding layers are unscaled.
    assert gemma3.rope_scaling == {"rope_type": "linear", "factor": 8.0}
    assert (gemma3.sliding_rope_theta, gemma3.sliding_rope_scaling) == (
        1e4, {"rope_type": "default"})
    nested = ModelConfig.from_dict({**base, "architectures": ["Gemma3ForCausalLM"],
                                    "rope_parameters": {
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}})
    assert (nested.rope_theta, nested.rope_scaling) == (1e6, {"rope_type": "linear", "factor": 8.0})
    assert (nested.sliding_rope_theta, nested.sliding_rope_scaling) == (
        1e4, {"rope_type": "default"})
    # Default pattern 6 when config.json gives none.
    assert get_architecture("Gemma3ForCausalLM").layer_types(
        ModelConfig.from_dict({**base, "num_hidden_layers": 7,
                               "architectures": ["Gemma3ForCausalLM"]})
    ) == [SLIDING_ATTENTION] * 5 + [FULL_ATTENTION, SLIDING_ATTENTION]


@pytest.mark.parametrize("case", sorted(CASES))
def test_paged_steps_match_each_sequence_alone(folders, case):
    """Mixed prefill chunks and decode rows over small pages (several per sequence),
    then decode-only steps (the fused CPU decode for Gemma 3, eager soft-capped
    attention for Gemma 2), as the generator drives them."""
    model = load_causal_lm(folders[case], "cpu")
    pool = PagePool(16, len(model.layers), model.config.num_kv_heads, model.config.head_dim,
                    model.dtype, model.device, KVCacheType(), page_size=4)
    sequences = [_ids(9, seed=13)[0].tolist(), _ids(3, seed=14)[0].tolist()]
    tables = [PageTable(pool), PageTable(pool)]
    for table, prompt in zip(tables, sequences, strict=True):
        assert table.admit(prompt, 24)
    # Step 1: both prompts partly; step 2: the rest of one, a decode token of the other.
    plan = [[sequences[0][:5], sequences[1]], [sequences[0][5:], [17]]]
    sequences[1] = sequences[1] + [17]
    for _ in range(4):  # then decode-only steps
        plan.append([[21], [23]])
    seen = [[], []]
    for chunks in plan:
        batch = PagedBatch(pool, tables, chunks)
        ids = torch.tensor([sum(chunks, [])])
        logits = model(ids, batch, last_logits_only=True)
        assert logits.shape == (1, 2, 300)
        for row, chunk in enumerate(chunks):
            seen[row] += chunk
            alone = model(torch.tensor([seen[row]]))[0, -1]
            assert (logits[0, row] - alone).abs().max() < TOLERANCE
    assert [table.length for table in tables] == [len(s) for s in seen]
    assert len(seen[0]) > 4 * 3  # the history spans several pages


@pytest.mark.parametrize("case", sorted(CASES))
def test_fixed_shape_decode_step_matches_the_paged_step(folders, case):
    """decode_step.DecodeRunner (what CUDA graphs capture), eager on CPU, rows of
    different lengths; the window (6) and the page buckets (8-token pages) are crossed."""
    model = load_causal_lm(folders[case], "cpu")
    prompts = [_ids(9, seed=15)[0].tolist(), _ids(2, seed=16)[0].tolist()]
    eager = PagedSequences(model, 2, 32, page_size=8)
    fixed = PagedSequences(model, 2, 32, page_size=8)
    runner = DecodeRunner(model, fixed.pool, max_batch=2, num_ctx=32, mode="static")
    logits = torch.cat(eager.feed(prompts, last_only=True))
    fixed.feed(prompts)
    for _ in range(12):
        tokens = logits.argmax(-1).tolist()
        static = runner.run(list(zip(fixed.tables, tokens, strict=True)))
        for table, token in zip(fixed.tables, tokens, strict=True):
            table.commit([token])
        logits = torch.cat(eager.feed([[t] for t in tokens]))
        assert (static - logits).abs().max() < TOLERANCE
    assert fixed.lengths == eager.lengths == [21, 14]
    assert len(runner._steps) >= 2  # more than one page bucket


@pytest.mark.parametrize("case", sorted(CASES))
def test_bfloat16_stays_close_to_transformers(folders, tmp_path, case):
    arch, overrides = CASES[case]
    folder = write_tiny_model(tmp_path, arch, dtype="bfloat16", **overrides)
    model = load_causal_lm(folder, device="cpu")
    assert model.dtype == torch.bfloat16
    # The 1 + w norm weights are kept in float32 (Gemma scales in float32).
    assert model.final_norm.weight.dtype == torch.float32
    ids = _ids(16, seed=17)
    reference = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
    with torch.no_grad():
        expected = reference.eval()(ids).logits.float()
    assert (model(ids) - expected).abs().max() < 0.05 * expected.abs().max()


def test_llama_decode_plan_kept_and_gemma_excluded(folders, tmp_path):
    """The whole-layer CPU decode kernels know nothing of Gemma's options."""
    gemma = [load_causal_lm(folders[case], "cpu") for case in sorted(CASES)]
    assert all(layer._decode_plan() is None for model in gemma for layer in model.layers)
    assert gemma[0].layers[0].attention.softcap == 3.0  # gemma2
    assert gemma[1].local_rotary is not None and gemma[0].local_rotary is None
    llama = load_causal_lm(write_tiny_model(tmp_path, "llama"), "cpu")
    layer = llama.layers[0]
    assert layer.attention_out_norm is None and layer.attention.scale is None
    assert llama.embed_scale is None and llama.final_softcap is None
    from exl3cli.ops import cpu_kernels
    if cpu_kernels.available():  # Llama's fast path is still taken
        assert layer._decode_plan() is not None


# --- EXL3 folders -----------------------------------------------------------------

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
EXL3_SMALL = {"num_hidden_layers": 1, "vocab_size": 128}


def _quantize_folder(src: Path, out: Path, k_bits: int) -> Path:
    """Every linear (and an untied lm_head) through the real trellis encoder; the rest
    (embeddings, the four norms per layer, q/k norms) copied as they are."""
    reader = WeightReader(src)
    writer = Exl3FolderWriter(out, json.loads((src / "config.json").read_text()), 2**40)
    for key in reader.keys():
        module = key.rsplit(".", 1)[0]
        if module == "lm_head" or module.rsplit(".", 1)[-1] in LINEARS:
            writer.add_linear_tensors(module, quantize_linear_plain(
                reader.get(key), k_bits, "mul1", None, seed=len(module)))
        else:
            writer.add_tensor(key, reader.get(key))
    writer.close(make_quantization_config(k_bits, k_bits, "mul1"))
    return out


@pytest.mark.parametrize("arch, tied", [("gemma2", True), ("gemma3", False)])
def test_exl3_gemma_folder_loads_and_tracks_the_original(tmp_path, arch, tied):
    overrides = {**EXL3_SMALL, "tie_word_embeddings": tied,
                 **(GEMMA2_CAPS if arch == "gemma2" else {})}
    src = write_tiny_model(tmp_path / "src", arch, **overrides)
    folder = _quantize_folder(src, tmp_path / "exl3", k_bits=8)
    reader = WeightReader(folder)
    assert reader.has("model.layers.0.self_attn.q_proj.trellis")
    assert reader.has("model.layers.0.post_feedforward_layernorm.weight")
    assert reader.has("lm_head.trellis") != tied
    model = load_causal_lm(folder, device="cpu")  # dequantized at load on CPU
    ids = torch.randint(0, 128, (2, 20), generator=torch.Generator().manual_seed(18))
    with torch.no_grad():
        expected = tiny_reference_model(arch, **overrides)(ids).logits.float()
    got = model(ids)
    corr = torch.corrcoef(torch.stack([got.flatten(), expected.flatten()]))[0, 1].item()
    assert corr > 0.99
    # The trellis path (decoded in forward) agrees with the dense-at-load one.
    trellis = load_causal_lm(folder, device="cpu", linear_mode="trellis")
    assert isinstance(trellis.layers[0].attention.o, Exl3Linear)
    assert (trellis(ids) - got).abs().max() < 1e-2


# --- Gemma 3 image-text checkpoints, text only ------------------------------------

VISION = {"model_type": "siglip_vision_model", "hidden_size": 32, "intermediate_size": 64,
          "num_hidden_layers": 1, "num_attention_heads": 2, "image_size": 28, "patch_size": 14}
# Keys hub configs leave out of text_config when they hold transformers' defaults.
AT_DEFAULTS = ("rms_norm_eps", "rope_parameters", "layer_types", "hidden_activation",
               "tie_word_embeddings", "_sliding_window_pattern", "use_bidirectional_attention")


def _multimodal_reference(folder: Path):
    """A tiny Gemma3ForConditionalGeneration (written to `folder`) whose language model
    holds the tiny Gemma 3 text model's weights."""
    text = tiny_reference_model("gemma3", rms_norm_eps=1e-6)
    config = transformers.Gemma3Config(
        text_config=text.config.to_dict(), vision_config=VISION, mm_tokens_per_image=4,
        image_token_index=299, boi_token_index=297, eoi_token_index=298)
    model = transformers.Gemma3ForConditionalGeneration(config).eval()
    model.model.language_model.load_state_dict(text.model.state_dict())
    model.tie_weights()
    model.save_pretrained(folder)
    return model


@pytest.mark.parametrize("variant", ["as_saved", "keys_at_defaults_left_out", "new_names"])
def test_gemma3_image_text_checkpoint_runs_as_text_model(tmp_path, variant):
    folder = tmp_path / "mm"
    reference = _multimodal_reference(folder)
    if variant == "keys_at_defaults_left_out":
        config = json.loads((folder / "config.json").read_text())
        for key in AT_DEFAULTS:
            config["text_config"].pop(key, None)
        (folder / "config.json").write_text(json.dumps(config))
    if variant == "new_names":  # transformers >= 4.52 in memory: model.language_model.*
        from safetensors.torch import load_file, save_file
        tensors = load_file(folder / "model.safetensors")
        renamed = {("model.language_model." + k.removeprefix("language_model.model."))
                   if k.startswith("language_model.model.") else k: v
                   for k, v in tensors.items()}
        save_file(renamed, folder / "model.safetensors", metadata={"format": "pt"})
    model = load_causal_lm(folder, device="cpu")
    assert model.config.architecture == "Gemma3ForConditionalGeneration"
    assert (model.config.hidden_size, model.config.sliding_rope_theta) == (64, 10000.0)
    ids = _ids(20, seed=19)
    with torch.no_grad():
        expected = reference(input_ids=ids).logits.float()
    assert (model(ids) - expected).abs().max() < TOLERANCE


@pytest.mark.parametrize("block", [512, 3])
def test_softcapped_attention_is_the_gemma2_formula(block):
    """Against the formula written out with repeated kv heads and an additive mask,
    whole and in query blocks (a block of 3 splits the 7 queries unevenly)."""
    from exl3cli.engine.kvcache.attention_math import softcapped_attention

    gen = torch.Generator().manual_seed(20)
    query = torch.randn(2, 4, 7, 8, generator=gen) * 3
    key, value = torch.randn(2, 2, 10, 8, generator=gen) * 3, torch.randn(2, 2, 10, 8, generator=gen)
    positions = torch.arange(3, 10)[:, None]
    allowed = (torch.arange(10) <= positions) & (torch.arange(10) > positions - 4)
    got = softcapped_attention(query, key, value, allowed[None, None], 0.3, 2.0, block=block)
    keys, values = key.repeat_interleave(2, dim=1), value.repeat_interleave(2, dim=1)
    scores = 2.0 * torch.tanh(query @ keys.transpose(-1, -2) * 0.3 / 2.0)
    scores = scores + torch.where(allowed, 0.0, float("-inf"))
    expected = torch.softmax(scores, dim=-1) @ values
    assert (got - expected).abs().max() < 1e-5
    assert (got - softcapped_attention(query, key, value, allowed, 0.3, 50.0)).abs().max() > 1e-2
