"""Where a conversion's host work goes, counted on the CPU: torch ops, syncs and Viterbi
waves per phase, for a GPU estimate (bench/NOTES-quant-quality.md section 9).

On the H200 a SmolLM2-135M conversion is bound by the host (Python + one launch per
torch op) and by the chain of small Viterbi launches inside LDLQ, not by FLOPs. This
script converts the first ``--layers`` layers of SmolLM2 (the test cache's GGUF, as
bench/quant_quality_cpu.py) on the CPU with the Viterbi search replaced by a stub (it
counts calls and tiles; the trellis it returns is junk, so only counts are meaningful)
and attributes every dispatched torch op to the innermost phase running: sensitivity
pass, LDLQ loop, scale search, scale refit, other quantize work, the rest. "syncs"
counts the ops that read a value back to the host (``.item()``, ``float(t)``);
"waves" counts Viterbi launches in units of 132 tiles (one 1024-thread block per tile,
one block per H200 SM). Copies of CPU tables to the GPU (another kind of sync) do not
show on the CPU: see the notes.

Usage: ``python bench/convert_ops_cpu.py --layers 2 --variant final --variant old``
(each variant: ``name=FIELD=VALUE,FIELD=VALUE``; "final" and "old" are built in).
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.quant_quality_cpu import smollm2_gguf  # noqa: E402
from exl3cli.convert import ldlq as ldlq_mod  # noqa: E402
from exl3cli.convert import pipeline, quantize_layer, sensitivity  # noqa: E402

VARIANTS = {"final": {}, "old": {"allocation": "fixed", "out_scales": "rms", "scale_refit": 0}}
SMS = 132
_stack = ["rest"]
ops: dict[str, Counter] = defaultdict(Counter)
seconds: dict[str, float] = defaultdict(float)


_VIEWS = {"slice", "view", "select", "permute", "transpose", "t", "expand", "unsqueeze",
          "squeeze", "alias", "detach", "as_strided", "split", "unbind", "diagonal",
          "_unsafe_view", "reshape", "narrow", "lift_fresh", "split_with_sizes", "unflatten"}


class _Count(TorchDispatchMode):
    """Counts the ops that launch work on a GPU (not views) by phase."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        phase = _stack[-1]
        if func.__name__.split(".")[0] not in _VIEWS:
            ops[phase]["ops"] += 1
        if func is torch.ops.aten._local_scalar_dense.default:
            ops[phase]["syncs"] += 1
        return func(*args, **(kwargs or {}))


def _phase(name: str, fn):
    def wrapped(*args, **kwargs):
        _stack.append(name)
        begun = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            seconds[name] += time.perf_counter() - begun
            _stack.pop()
    return wrapped


def _fake_viterbi(targets: torch.Tensor, k_bits: float, codebook: str = "mul1") -> torch.Tensor:
    n = targets.shape[0]
    ops[_stack[-1]]["viterbi calls"] += 1
    ops[_stack[-1]]["tiles"] += n
    ops[_stack[-1]]["waves"] += math.ceil(n / SMS)
    return (targets.abs() * 997).long().remainder(65536)


def _fake_segments(targets: torch.Tensor, k_bits: list, counts: list,
                   codebook: str = "mul1") -> torch.Tensor:
    return _fake_viterbi(targets, k_bits[0], codebook)  # one launch for all segments


def _warm() -> None:
    """Fill the codec's per-K caches, so only steady-state ops are counted."""
    from exl3cli.codec.bitstream import pack_states, unpack_states

    for k in range(1, 9):
        unpack_states(pack_states(torch.zeros(1, 256, dtype=torch.int64), k), k)


def _install() -> None:
    _warm()
    ldlq_mod.viterbi_states = _fake_viterbi
    if hasattr(ldlq_mod, "viterbi_states_segments"):
        ldlq_mod.viterbi_states_segments = _fake_segments
    quantize_layer.viterbi_states = _fake_viterbi
    quantize_layer.ldlq = _phase("ldlq", ldlq_mod.ldlq)
    if hasattr(quantize_layer, "ldlq_parts"):  # mixed-K groups, in lock step
        quantize_layer.ldlq_parts = _phase("ldlq", ldlq_mod.ldlq_parts)
    quantize_layer._search_scales = _phase("scale search", quantize_layer._search_scales)
    quantize_layer._refit = _phase("refit", quantize_layer._refit)
    quantize_layer.group_scales = _phase("scales", quantize_layer.group_scales)
    sensitivity.measure = _phase("sensitivity", sensitivity.measure)
    pipeline.quantize_mixed = _phase("quantize (rest)", pipeline.quantize_mixed)
    pipeline.quantize_group = _phase("quantize (rest)", pipeline.quantize_group)


def _source(layers: int, work: Path) -> Path:
    from exl3cli.gguf.convert import gguf_to_hf_folder

    full = work / "smollm2-hf"
    if not (full / "config.json").is_file():
        gguf_to_hf_folder(smollm2_gguf(), full)
    cut = work / f"smollm2-{layers}l"
    if not (cut / "config.json").is_file():
        cut.mkdir(parents=True, exist_ok=True)
        for f in full.iterdir():
            if f.name != "config.json":
                (cut / f.name).unlink(missing_ok=True)
                (cut / f.name).symlink_to(f)
        config = json.loads((full / "config.json").read_text())
        config["num_hidden_layers"] = layers
        (cut / "config.json").write_text(json.dumps(config))
    return cut


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--bits", type=float, default=4.0)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--cols", type=int, default=256)
    parser.add_argument("--variant", action="append", default=[])
    parser.add_argument("--work", default="/tmp/convert-ops")
    args = parser.parse_args()
    work = Path(args.work)
    src = _source(args.layers, work)
    _install()
    for spec in args.variant or ["final", "old"]:
        name, _, rest = spec.partition("=")
        fields = dict(VARIANTS.get(name, {}))
        for item in filter(None, rest.split(",")):
            key, value = item.split("=", 1)
            fields[key] = type(getattr(pipeline.ConvertOptions(bits=1), key))(value)
        ops.clear()
        seconds.clear()
        options = pipeline.ConvertOptions(bits=args.bits, rows=args.rows, cols=args.cols,
                                          device="cpu", **fields)
        out = work / f"out-{name}"
        begun = time.perf_counter()
        with _Count():
            summary = pipeline.convert_model(src, out, options, work / f"w-{name}", force=True)
        total = time.perf_counter() - begun
        shutil.rmtree(out, ignore_errors=True)
        print(f"== {name} ({fields}): {total:.1f} s CPU wall, {args.layers} layers, "
              f"bits {sorted({b for r in summary.layers for b in r.tensor_bits.values()})}")
        print(f"{'phase':18} {'ops':>8} {'syncs':>6} {'vit calls':>9} {'waves':>6} {'s':>7}")
        for phase in sorted(ops, key=lambda p: -ops[p]["ops"]):
            c = ops[phase]
            print(f"{phase:18} {c['ops']:8d} {c['syncs']:6d} {c['viterbi calls']:9d} "
                  f"{c['waves']:6d} {seconds.get(phase, 0.0):7.2f}")
        for r in summary.layers:
            print(f"  layer {r.layer}: {r.tensor_bits}")


if __name__ == "__main__":
    main()
