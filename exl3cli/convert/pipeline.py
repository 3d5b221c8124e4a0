"""Convert a Hugging Face model folder to EXL3, layer by layer, with resumable checkpoints.

Layers are quantized in order on calibration activations that went through the
already-quantized earlier layers (and, inside a layer, o_proj and down_proj see the
outputs of the quantized q/k/v and gate/up). After each layer its stored tensors are
written atomically to ``work_dir/layer-NNNN.safetensors`` (work_folder.py);
``resume=True`` reloads them and only recomputes activations. The output folder is
always written from the checkpoints, and everything random is seeded, so a killed and
resumed run writes the same bytes as an uninterrupted one. Every family is calibrated
through the engine's own decoder layers (engine_layer.py), so the activations it is
quantized on are the ones it computes; a multimodal wrapper's text model is converted
and its other tensors (vision tower, projector) are kept at 16 bits under ExLlamaV3's
names.

Public API:
- ``ConvertOptions(bits, head_bits=6, codebook="mul1", rows, cols, calib_path, damping,
  scale_search_tiles, seed, device, recipe=(), allocation="measured", sensitivity_rows=8,
  allocation_unit="tensor", out_scales="fisher")``: ``bits`` may be None when ``recipe``
  fixes every tensor; ``allocation`` "measured" (bits per tensor from a sensitivity pass
  and a knapsack: allocation_plan.py) or "fixed" (allocation.py's fixed order);
  ``out_scales`` "fisher" (output-channel scales from the same pass's Fisher
  information, quantize_layer.fisher_out_scales, at ``fisher_strength`` 0.5: half-way,
  geometrically, from the RMS to the optimum for the measured F, which lost KL at 4 bpw
  on the CPU benchmark, bench/NOTES-quant-quality.md) or "rms" (the column RMS);
  ``scale_refit`` rounds of the least-squares refit of every quantized linear's
  suh/svh once its trellis is searched (scale_refit.py; default 2, 0: none); ``embed_bits`` 1..8
  stores the token embedding trellis-quantized as ExLlamaV3 does (embed_quant.py; the
  layers are calibrated on the decoded table), 16 keeps it.
- ``convert_model(src, out_dir, options, work_dir, resume=False, progress=None)
  -> ConversionSummary`` (``progress`` receives each ``LayerReport`` and status strings).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from exl3cli.codec import dequantize_linear
from exl3cli.codec.format import padded_size
from exl3cli.convert.allocation import GroupShape
from exl3cli.convert.allocation_plan import BitPlan, make_plan, representative_bits
from exl3cli.convert.calibration import (
    DEFAULT_COLS,
    DEFAULT_ROWS,
    calibration_tokens,
    read_calibration_text,
)
from exl3cli.convert.embed_quant import embed_checkpoint
from exl3cli.convert.engine_layer import LINEAR_SLOTS, EngineLayerForward
from exl3cli.convert.fused_source import split_fused
from exl3cli.convert.hessian import HessianAccumulator
from exl3cli.convert.mla_layer import latent_kept_modules, latent_norm_names, quantize_latent
from exl3cli.convert.moe_layer import (
    kept_dense_modules,
    layer_modules,
    moe_units,
    quantize_experts,
)
from exl3cli.convert.output_folder import RECIPE_FILE, write_output
from exl3cli.convert.quantize_layer import (
    QuantizedLinear,
    QuantSettings,
    quantize_group,
    quantize_mixed,
)
from exl3cli.convert.report import ConversionSummary, LayerReport
from exl3cli.convert.work_folder import (
    atomic_save,
    load_checkpoint,
    module_tensors,
    prepare_work_dir,
)
from exl3cli.engine.layers.fused_experts import split_fused_experts
from exl3cli.engine.models.weights import WeightReader
from exl3cli.engine.spec.architecture import get_architecture, load_family_config
from exl3cli.engine.text.tokenizer import Tokenizer

PLAN_FILE = "plan.json"
FISHER_FILE = "out-fisher.safetensors"


@dataclass(frozen=True)
class ConvertOptions:
    bits: float | None
    head_bits: int = 6
    codebook: str = "mul1"
    rows: int = DEFAULT_ROWS
    cols: int = DEFAULT_COLS
    calib_path: str | None = None
    damping: float = 0.02
    scale_search_tiles: int = 16
    seed: int = 0
    device: str | None = None
    recipe: tuple[tuple[str, int], ...] = ()
    allocation: str = "measured"
    sensitivity_rows: int = 8
    allocation_unit: str = "tensor"  # or "group": q/k/v and gate/up share their bits
    out_scales: str = "fisher"  # or "rms"
    fisher_strength: float = 0.5  # fisher_out_scales: 1 = the optimum for the measured F
    scale_refit: int = 2  # rounds of the suh/svh refit after the search (scale_refit.py)
    embed_bits: int = 16  # the token embedding table: 1..8 trellis bits (embed_quant.py)


Progress = Callable[[LayerReport | str], None]


def _group_shapes(conv: _Converter) -> list[GroupShape]:
    shapes = []
    for i in range(conv.config.num_layers):
        for group, modules in conv.layer_modules(i).items():
            weights = 0
            for m in modules:
                out_f, in_f = conv.reader.get(m + ".weight").shape
                weights += padded_size(in_f) * padded_size(out_f)
            shapes.append(GroupShape(i, group, weights))
    return shapes


class _Converter:
    def __init__(self, src: Path, options: ConvertOptions, work_dir: Path, progress: Progress):
        self.src, self.options, self.work_dir, self.progress = src, options, work_dir, progress
        self.config = load_family_config(src)
        self.spec = get_architecture(self.config.architecture)
        self.reader = WeightReader(src)
        # A multimodal wrapper's text model (Gemma 3 4B+) is converted under its names.
        self.names = self.spec.tensor_names(self.reader.has)
        # Fused q/k/v and gate/up (Phi-3, GLM-4) are converted as the split modules
        # EXL3 folders hold.
        self.reader, self.names = split_fused(self.reader, self.config, self.names)
        # Experts stored as one tensor per layer (gpt-oss) are written per expert.
        self.reader = split_fused_experts(self.reader, self.config, self.spec)
        self.device = torch.device(options.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.engine_layers = EngineLayerForward(self.config, self.spec, self.names, self.device)
        self.out_fisher: dict[str, torch.Tensor] = {}  # module -> F per output channel
        self.embed_table: torch.Tensor | None = None  # the quantized table, decoded

    def weight(self, module: str) -> torch.Tensor:
        """(in, out) float32 on the working device."""
        return self.reader.get(module + ".weight", dtype=torch.float32, device=self.device).T

    def tensor(self, name: str) -> torch.Tensor:
        return self.reader.get(name, dtype=torch.float32, device=self.device)

    def bias(self, module: str) -> torch.Tensor | None:
        name = module + ".bias"
        return self.tensor(name) if self.reader.has(name) else None

    def head_name(self) -> str:
        """The output head's module name."""
        return self.names.lm_head.removesuffix(".weight")

    def embed_name(self) -> str:
        """The token embedding's module name."""
        return self.names.embed.removesuffix(".weight")

    def head_weight(self) -> torch.Tensor:
        """The output head's (in, out) weight; a tied head copies the embedding."""
        t = self.names
        name = t.lm_head if self.reader.has(t.lm_head) else t.embed
        return self.tensor(name).T

    def settings(self, k_bits: int) -> QuantSettings:
        o = self.options
        return QuantSettings(k_bits, o.codebook, o.damping, o.scale_search_tiles, o.seed,
                             o.fisher_strength, o.scale_refit)

    def quantize(self, modules: list[str], x: torch.Tensor, k_bits: int | list[int],
                 hessian: torch.Tensor | None = None) -> list[QuantizedLinear]:
        """Quantize `modules` (one input) on the Hessian of `x`, or on `hessian`;
        ``k_bits`` for all, or per module (16: kept unquantized, left out of the result)."""
        per_module = k_bits if isinstance(k_bits, list) else [k_bits] * len(modules)
        chosen = [(m, k) for m, k in zip(modules, per_module, strict=True) if k <= 8]
        if not chosen:
            return []
        if hessian is None:
            acc = HessianAccumulator(x.shape[-1], self.device)
            acc.add(x)
            hessian = acc.hessian()
        names = [m for m, _ in chosen]
        fisher = [self.out_fisher.get(m) for m in names]
        return quantize_mixed(
            names, [self.weight(m) for m in names], [self.bias(m) for m in names],
            hessian, self.settings(chosen[0][1]), [k for _, k in chosen],
            [None if f is None else f.to(self.device) for f in fisher],
        )

    def layer_modules(self, i: int) -> dict[str, list[str]]:
        return layer_modules(self.spec, self.names, self.config, i)

    def kept_modules(self, i: int) -> list[str]:
        """Layer `i`'s linears kept at 16 bits: a router, MLA's kv_b_proj."""
        kept = kept_dense_modules(self.spec, self.config, i)
        return kept + (latent_kept_modules(self.names, i) if self.spec.mla else [])

    def kept_dense(self, i: int) -> dict[str, tuple]:
        """Layer `i`'s kept linears, as the source has them."""
        return {m: (self.weight(m), self.bias(m)) for m in self.kept_modules(i)}

    def norm_names(self, i: int) -> list[str]:
        """Layer `i`'s small tensors written as they are: norms, attention sinks and a
        router's choice bias."""
        t = self.names
        names = [] if self.spec.post_norm else [t.input_norm.format(i=i)]
        if not (self.spec.post_norm or self.spec.parallel_block):  # one norm feeds both
            names.append(t.post_attention_norm.format(i=i))
        if self.spec.sandwich_norm:
            names += [t.attention_out_norm.format(i=i), t.mlp_out_norm.format(i=i)]
        if self.spec.uses_qk_norm(self.config):
            names += [t.q_norm.format(i=i), t.k_norm.format(i=i)]
        if self.spec.attention_sinks:
            names.append(t.sinks.format(i=i))
        if self.spec.mla:
            names += latent_norm_names(t, self.config, i)
        moe = self.spec.moe
        if moe is not None and moe.score_bias and moe.is_sparse(self.config, i):
            names.append(moe.score_bias.format(i=i))  # the router's choice bias
        return names

    def embeddings(self, tokens: torch.Tensor) -> torch.Tensor:
        table = self.embed_table if self.embed_table is not None else self.tensor(self.names.embed)
        return self.engine_layers.embed(tokens, table)

    def run_layer(self, i: int, hidden: torch.Tensor, dense: dict[str, tuple]) -> torch.Tensor:
        """Layer `i`'s output for `hidden`, with the linears in `dense`."""
        engine = self.engine_layers
        return engine.run(engine.build(i, dense, self.tensor), hidden)

    def quantize_layer(self, i: int, hidden: torch.Tensor, bits: dict[str, int]) -> dict:
        """Quantize layer `i` (``bits``: module -> bits, 16: kept), each group on the
        input it gets once the groups before it are quantized: the stored tensors, the
        proxy errors by group and, for experts, the rows each one received."""
        engine, mods = self.engine_layers, self.layer_modules(i)
        stored, errors = {}, {}
        counts = attended = None  # attended: o's input, once q/k/v are quantized
        dense = {m: (self.weight(m), self.bias(m)) for ms in mods.values() for m in ms}
        dense.update(self.kept_dense(i))
        for group in LINEAR_SLOTS:
            if group in ("gate_up", "down") and moe_units(self.spec, self.config, i, group):
                # Experts share their group's bits (allocation_plan.py).
                results, counts = quantize_experts(self, i, hidden, dense, group,
                                                   bits[mods[group][0]], attended)
            elif group == "qkv" and self.spec.mla:  # in two stages (mla_layer.py)
                results = quantize_latent(self, i, hidden, dense, bits)
            else:
                # The MLP's groups replay the attention from o's input (engine_layer.py).
                layer = engine.build(i, dense, self.tensor)
                x = engine.linear_input(layer, hidden, group, attended)
                # MLA's o_proj reads the value heads without their padding.
                read = layer.attention.o.narrow(x) if group == "o" and self.spec.mla else x
                results = self.quantize(mods[group], read, [bits[m] for m in mods[group]])
                attended = x if group == "o" else attended
                del x, read
            for q in results:
                dense[q.name] = (q.weight, self.bias(q.name))
                stored.update({f"{q.name}.{k}": v for k, v in q.tensors.items()})
            errors[group] = sum(q.proxy_error for q in results) / max(1, len(results))
        return {"stored": stored, "errors": errors, "expert_tokens": counts}

    def dense_from_stored(self, stored: dict[str, torch.Tensor], i: int) -> dict:
        modules = [m for ms in self.layer_modules(i).values() for m in ms]
        dense = self.kept_dense(i)
        for m in modules:
            out_f, in_f = self.reader.get(m + ".weight").shape
            tensors = module_tensors(stored, m)
            if not tensors:  # kept at 16 bits
                dense[m] = (self.weight(m), self.bias(m))
                continue
            w = dequantize_linear({k: v.to(self.device) for k, v in tensors.items()}, in_f, out_f)
            dense[m] = (w, self.bias(m))
        return dense


def convert_model(
    src: str | Path,
    out_dir: str | Path,
    options: ConvertOptions,
    work_dir: str | Path,
    resume: bool = False,
    progress: Progress | None = None,
    force: bool = False,
) -> ConversionSummary:
    """Quantize the HF model in ``src`` into an EXL3 folder ``out_dir``. Without
    ``resume``, finished layers of an earlier run in ``work_dir`` are deleted only with
    ``force`` (ConversionError otherwise)."""
    started = time.perf_counter()
    src, out_dir, work_dir = Path(src), Path(out_dir), Path(work_dir)
    progress = progress or (lambda _event: None)
    conv = _Converter(src, options, work_dir, progress)
    job = {"source": str(src.resolve()), "options": asdict(options) | {"device": None}}
    job = json.loads(json.dumps(job))  # as it reads back from job.json (tuples: lists)
    prepare_work_dir(work_dir, job, resume, force)

    shapes = _group_shapes(conv)
    tokenizer = Tokenizer.from_folder(src)
    text = read_calibration_text(options.calib_path)
    tokens = calibration_tokens(tokenizer, text, options.rows, options.cols).to(conv.device)
    plan = _load_or_make_plan(conv, shapes, tokens, work_dir, resume)
    conv.out_fisher = plan.fisher
    bits = plan.tensor_bits
    extra = {}
    if plan.embed_bits <= 8:  # the layers are calibrated on the table a loader decodes
        table = embed_checkpoint(conv, work_dir, resume, plan.embed_bits)
        conv.embed_table = table["decoded"].to(conv.device, torch.float32)
        progress(f"embedding {plan.embed_bits}b {table['error']:.2e}")
        extra = {"embed_bits": plan.embed_bits, "embed_error": table["error"]}
    hidden = conv.embeddings(tokens)
    target = options.bits if options.bits is not None else round(plan.average, 3)
    progress(f"quantizing {conv.config.num_layers} layers to {target} bits per "
             f"weight, bits per tensor by {plan.method} ({options.rows} x {options.cols} "
             "calibration tokens); an estimate of the time left follows each layer")

    reports = []
    with torch.inference_mode():
        for i in range(conv.config.num_layers):
            layer_mods = conv.layer_modules(i)
            layer_bits = {m: bits[m] for ms in layer_mods.values() for m in ms}
            path = work_dir / f"layer-{i:04d}.safetensors"
            begun = time.perf_counter()
            if resume and path.is_file():
                stored, meta = load_checkpoint(path)
                report = LayerReport.from_dict(meta)
            else:
                out = conv.quantize_layer(i, hidden, layer_bits)
                stored = out["stored"]
                report = LayerReport(i, representative_bits(layer_mods, bits), out["errors"],
                                     time.perf_counter() - begun,
                                     expert_tokens=out.get("expert_tokens"),
                                     tensor_bits=_short_bits(layer_mods, bits))
                atomic_save(stored, path, {"report": json.dumps(report.to_dict())})
            # Activations always come from the stored tensors, in both paths alike.
            hidden = conv.run_layer(i, hidden, conv.dense_from_stored(stored, i))
            reports.append(report)
            progress(report)
        head_error = _head(conv, hidden, work_dir, resume, plan.head_bits)
    del hidden

    progress("writing output folder")
    write_output(conv, out_dir, work_dir, plan)
    return ConversionSummary(
        reports, plan.head_bits, head_error, plan.average,
        time.perf_counter() - started, out_dir,
        extra={"allocation": plan.method, "recipe": str(out_dir / RECIPE_FILE), **extra},
    )


def _short_bits(layer_mods: dict[str, list[str]], bits: dict[str, int]) -> dict[str, int]:
    """A layer's bits by the last part of each module name (q_proj, down_proj, ...)."""
    return {m.rsplit(".", 1)[-1]: bits[m] for ms in layer_mods.values() for m in ms
            if len(ms) <= 3}


def _load_or_make_plan(conv: _Converter, shapes: list[GroupShape], tokens: torch.Tensor,
                       work_dir: Path, resume: bool) -> BitPlan:
    """The bits of every tensor; a resumed run reuses the plan its first run saved."""
    path, fisher_path = work_dir / PLAN_FILE, work_dir / FISHER_FILE
    if resume and path.is_file():
        plan = BitPlan.from_dict(json.loads(path.read_text(encoding="utf-8")))
        if fisher_path.is_file():
            plan.fisher = load_checkpoint(fisher_path)[0]
        return plan
    plan = make_plan(conv, shapes, tokens, conv.head_name(), _Converter.head_weight,
                     conv.embed_name())
    if plan.fisher:
        atomic_save(plan.fisher, fisher_path, {"report": "{}"})
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(plan.to_dict()), encoding="utf-8")
    os.replace(tmp, path)
    return plan


def _head(conv: _Converter, hidden: torch.Tensor, work_dir: Path, resume: bool,
          head_bits: int) -> float | None:
    if head_bits >= 16:
        return None
    path = work_dir / "head.safetensors"
    if resume and path.is_file():
        return float(load_checkpoint(path)[1]["error"])
    x = conv.engine_layers.final_norm(hidden, conv.tensor(conv.names.final_norm))
    acc = HessianAccumulator(x.shape[-1], conv.device)
    acc.add(x)
    name = conv.head_name()
    q, = quantize_group([name], [conv.head_weight()], [None], acc.hessian(),
                        conv.settings(head_bits))
    atomic_save({f"{name}.{k}": v for k, v in q.tensors.items()}, path,
                 {"report": json.dumps({"error": q.proxy_error})})
    conv.progress(f"head {head_bits}b {q.proxy_error:.2e}")
    return q.proxy_error
