"""Build a CausalLM from a Hugging Face model folder (each decoder layer: decoder_layer.py)."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from exl3cli.engine.layers.cpu_exl3 import compressed_linear
from exl3cli.engine.layers.fused_experts import split_fused_experts
from exl3cli.engine.layers.linear import (
    CPU_WEIGHT_MODES,
    DenseLinear,
    Linear,
    fuse_linears,
    load_linear,
    pack_for_cpu,
    scale_outputs,
)
from exl3cli.engine.layers.offload import offload_linear
from exl3cli.engine.layers.parallel import AbsentLinear
from exl3cli.engine.layers.streamed import LayerStreamer
from exl3cli.engine.models.causal_lm import CausalLM
from exl3cli.engine.models.decoder_layer import build_decoder_layer, family_norm
from exl3cli.engine.models.placement import (
    DEFAULT_NUM_CTX,
    cpu_budget,
    estimate_memory,
    gpu_budget,
    offload_mode,
    plan_placement,
)
from exl3cli.engine.models.residual_scale import scale_residual_stream, wants_residual_scale
from exl3cli.engine.models.weights import WeightReader
from exl3cli.engine.spec.architecture import (
    ArchitectureSpec,
    get_architecture,
    load_family_config,
)
from exl3cli.engine.spec.config import ModelConfig
from exl3cli.errors import InvalidOption, ModelLoadError, UnsupportedArchitecture
from exl3cli.ops import cpu_kernels
from exl3cli.ops.cpu_gemv_mode import set_exl3_gemv_mode

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def default_dtype(config: ModelConfig, device: torch.device) -> torch.dtype:
    """The checkpoint's dtype on GPU; on CPU bfloat16 for bf16 checkpoints, else float32."""
    stored = _DTYPES.get(str(config.torch_dtype).removeprefix("torch."), torch.float32)
    if device.type == "cpu":
        return torch.bfloat16 if stored == torch.bfloat16 else torch.float32
    return stored


# "exl3": EXL3 layers keep their packed trellis (engine/layers/cpu_exl3.py), dense ones are
# packed as "fp32" packs them.
LOADER_CPU_WEIGHT_MODES = (*CPU_WEIGHT_MODES, "exl3")


def resolve_cpu_weights(cpu_weights: str | None, device: torch.device,
                        dtype: torch.dtype) -> str | None:
    """How linear weights are held on CPU: ``cpu_weights``, else ``EXL3_CPU_WEIGHTS``,
    else "exl3" (the default when the CPU kernels are built; EXL3 layers keep their
    packed trellis, decoded inside the matmul, for any activation dtype; dense layers
    packed as "fp32"; bench/NOTES-cpu-exl3.md). "fp32" (exact; packed for the decode
    kernel), "bf16" and "int8" dequantize EXL3 layers at load and need float32
    activations (bench/NOTES.md). None (plain F.linear) off the CPU, for other
    activation dtypes, or when asked for with "off"."""
    mode = cpu_weights or os.environ.get("EXL3_CPU_WEIGHTS", "") or "default"
    if mode == "default":  # memory first: EXL3 at its file size, dense layers as fp32
        mode = "exl3" if cpu_kernels.available() else "fp32"
    if mode != "off" and mode not in LOADER_CPU_WEIGHT_MODES:
        raise InvalidOption(f"cpu weights must be one of {', '.join(LOADER_CPU_WEIGHT_MODES)} "
                            f"or off, got {mode!r}")
    if mode == "off" or device.type != "cpu":
        return None
    if mode == "exl3":  # any activation dtype: the kernel computes in float32
        return mode
    if dtype != torch.float32:
        return None
    if mode == "fp32" and not cpu_kernels.available():
        return None  # without the kernel, F.linear on the plain matrix is the faster path
    return mode


def cpu_exl3_dtype(reader: WeightReader, device: torch.device,
                   cpu_weights: str | None) -> torch.dtype | None:
    """float32 for an EXL3 folder on the CPU in the ``exl3`` weight mode, whatever the
    checkpoint's dtype: the kernels compute in float32 either way, and only float32
    activations take the two-call decode layer (a bfloat16 run converts around every
    projection and runs ~25 ops per layer: 62 vs 40 ms a SmolLM2 token,
    bench/NOTES-cpu-exl3.md); bf16/fp16 embedding tables stay at their stored size.
    None otherwise (``default_dtype`` decides)."""
    if device.type != "cpu" or not any(k.endswith(".trellis") for k in reader.keys()):
        return None
    if resolve_cpu_weights(cpu_weights, device, torch.float32) != "exl3":
        return None
    return torch.float32


def load_causal_lm(
    folder: str | Path,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    *,
    linear_mode: str | None = None,
    cpu_weights: str | None = None,
    gpu_layers: int | None = None,
    num_ctx: int | None = None,
    offload: str | None = None,
) -> CausalLM:
    """Load the model in `folder`; ModelLoadError / UnsupportedArchitecture on failure.

    EXL3 layers are dequantized at load on CPU and decoded in forward on CUDA;
    `linear_mode` ("dense" or "trellis") forces one way (see engine/layers/linear.py).
    `cpu_weights` ("fp32", "bf16", "int8", "exl3", "off"): see `resolve_cpu_weights`.
    Memory is planned first (engine/models/placement.py): `gpu_layers` (Ollama's num_gpu; None
    or -1: as many as fit) decoder layers on the device, the rest offloaded: run on the
    CPU, or with `offload` "stream" (default ``EXL3_OFFLOAD``) streamed to the device
    from pinned host memory (engine/layers/streamed.py); a load that cannot fit
    `num_ctx` tokens of cache refuses. The plan is `model.placement`."""
    config = load_family_config(folder)
    spec = get_architecture(config.architecture)
    device = torch.device(device) if device is not None else default_device()
    weights = WeightReader(folder)
    dtype = dtype or cpu_exl3_dtype(weights, device, cpu_weights) or default_dtype(config, device)
    reader = split_fused_experts(weights, config, spec)
    packing = resolve_cpu_weights(cpu_weights, device, dtype)
    if packing == "exl3" and cpu_kernels.available():
        try:  # EXL3_CPU_GEMV: the 1-2 row product, exact (default) or fast
            set_exl3_gemv_mode()
        except ValueError as error:
            raise InvalidOption(str(error)) from None
    expand = None
    if device.type == "cpu" and (packing != "exl3" or linear_mode == "dense") \
            and linear_mode != "trellis":
        expand = {"bf16": 2, "int8": 1}.get(packing or "", torch.finfo(dtype).bits // 8)
    estimate = estimate_memory(folder, config, dtype, num_ctx or DEFAULT_NUM_CTX, expand)
    streamed = offload_mode(offload) == "stream"
    placement = plan_placement(estimate, gpu_budget(device), cpu_budget(), gpu_layers,
                               streamed=streamed)
    if placement.gpu_layers == 0 and device.type != "cpu" and not placement.streamed:
        device = torch.device("cpu")  # num_gpu 0: all on the CPU
        dtype = cpu_exl3_dtype(weights, device, cpu_weights) or default_dtype(config, device)
    model = build_causal_lm(config, spec, reader, device, dtype, linear_mode=linear_mode,
                            cpu_weights=cpu_weights, offload_from=placement.gpu_layers,
                            streamed=placement.streamed)
    model.placement = placement
    return model


def build_causal_lm(
    config: ModelConfig,
    spec: ArchitectureSpec,
    reader: WeightReader,
    device: torch.device,
    dtype: torch.dtype,
    *,
    linear_mode: str | None = None,
    cpu_weights: str | None = None,
    offload_from: int | None = None,
    layer_devices: list[torch.device] | None = None,
    streamed: bool = False,
) -> CausalLM:
    """Assemble the shared blocks as `spec` describes, with weights from `reader`;
    the projections of layers from `offload_from` on run on the CPU (engine/layers/offload.py),
    or with `streamed` are streamed to `device` (engine/layers/streamed.py).
    `layer_devices` (a layer split, layer_split.py): decoder layer i's weights on
    `layer_devices[i]`; embeddings, final norm and head on `device`."""
    names = spec.tensor_names(reader.has)
    packing = resolve_cpu_weights(cpu_weights, device, dtype)
    if packing == "exl3" and linear_mode is not None:  # an explicit Exl3Linear mode wins
        packing = "fp32" if dtype == torch.float32 else None
    dense_packing = packing
    if packing == "exl3":
        dense_packing = "fp32" if dtype == torch.float32 else None

    place = {"device": device}  # where the layer being built goes

    def tensor(name: str) -> torch.Tensor:
        return reader.get(name, dtype=dtype, device=place["device"]).contiguous()

    absent = getattr(reader, "absent", None)  # modules another tensor-parallel rank holds

    def linear(prefixes: list[str], shapes: list[tuple[int, int]], bias: bool) -> Linear:
        # Each module as stored (dense .weight or EXL3 .trellis), trimmed to its logical
        # (in, out) shape; fused projections concatenate along the output dimension.
        if absent is not None and all(absent(p) for p in prefixes):
            return AbsentLinear(shapes[0][0], sum(o for _, o in shapes))
        mode = linear_mode or ("trellis" if packing == "exl3" else None)
        parts = [
            load_linear(reader, p, i, o, place["device"], dtype, mode=mode, require_bias=bias)
            for p, (i, o) in zip(prefixes, shapes, strict=True)
        ]
        if packing == "exl3":
            return compressed_linear(parts, dense_packing)
        fused = fuse_linears(parts)
        return pack_for_cpu(fused, packing) if packing else fused

    layer_types = spec.layer_types(config)
    if len(layer_types) != config.num_layers:
        raise ModelLoadError("config.json layer_types does not match num_hidden_layers")
    if config.raw.get("use_bidirectional_attention"):
        raise UnsupportedArchitecture("bidirectional attention (an embedding model's "
                                      "config) is not supported")
    def offloaded(prefixes: list[str], shapes: list[tuple[int, int]], bias: bool) -> Linear:
        return offload_linear([
            load_linear(reader, p, i, o, "cpu", torch.float32, mode="trellis", require_bias=bias)
            for p, (i, o) in zip(prefixes, shapes, strict=True)
        ], device)

    first_offloaded = config.num_layers if offload_from is None else offload_from
    streamer = LayerStreamer(device) if streamed else None
    layers = []
    for i in range(config.num_layers):
        place["device"] = layer_devices[i] if layer_devices is not None else device
        resident = i < first_offloaded or streamer is not None
        layers.append(build_decoder_layer(config, spec, names, i, layer_types[i], tensor,
                                          linear if resident else offloaded))
        if streamer is not None and i >= first_offloaded:
            streamer.add(layers[-1], i)  # its trellises to host memory before the next
    place["device"] = device
    if streamer is not None:
        streamer.finish(layers)
    hidden = config.hidden_size
    head_prefix = names.lm_head.removesuffix(".weight")
    quantized_head = reader.has(head_prefix + ".trellis")
    embed = reader.get(names.embed)
    if packing == "exl3" and quantized_head and embed.dtype in (torch.float16, torch.bfloat16):
        embed = embed.to(device).clone()  # only looked up (untied): kept at its stored size
    else:
        embed = embed.to(device, dtype).contiguous()
    lm_head: Linear | torch.Tensor
    if quantized_head:  # EXL3 stores the head quantized, untied
        lm_head = linear([head_prefix], [(hidden, config.vocab_size)], False)
    elif config.tie_word_embeddings or not reader.has(names.lm_head):
        # Tied: fp32 shares the embedding's storage (no second copy of the largest
        # matrix); the low-precision modes add a smaller packed copy for the head.
        lm_head = (embed if dense_packing in (None, "fp32")
                   else DenseLinear(embed, cpu_weights=dense_packing))
    else:
        lm_head = linear([head_prefix], [(hidden, config.vocab_size)], False)
    logit_scale = config.raw.get("logit_scale")
    if logit_scale is not None and float(logit_scale) != 1.0:  # Cohere: folded in
        lm_head = scale_outputs(lm_head, float(logit_scale), dense_packing)
    final_norm = family_norm(config, spec, tensor(names.final_norm))
    model = CausalLM(config, spec, embed, layers, final_norm, lm_head,
                     compute_dtype=dtype).eval()
    if wants_residual_scale(spec, dtype):  # float16 Gemma: the stream would overflow
        scale_residual_stream(model)
    model.tensor_names = names  # the checkpoint's module names (LoRA adapters: engine/adapters/lora.py)
    model.streamer = streamer
    return model
