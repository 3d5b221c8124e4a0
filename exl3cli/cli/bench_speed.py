"""Speed benchmark of a local model (`exl3 bench MODEL`, `exl3 bench --synthetic SHAPE`).

Everything runs through the generator, the path `run` and `serve` take, so these are
the numbers users get. For each batch size and prompt length, `batch` concurrent
greedy jobs: prefill tokens/s (the steps that take the prompts, in one step of the
whole batch), then generation tokens/s over the steps that only decode (the second of
two runs of each configuration, so CUDA graphs are captured before the timed one). Batch-1 generation
is set against the memory-bandwidth limit: bytes a decode step must read (weights as
stored, one embedding row, the KV cache up to the context) over the measured device
copy rate (bytes read + written). On CUDA a last run measures peak memory with a
`memory_context`-token cache against weights + cache + a stated workspace.

Public API: ``run_speed(folder, *, prompt_lengths, gen_tokens, batches, device=None,
memory_context=8192, graphs=True, label=None, seed=0) -> dict`` (JSON-ready),
``format_speed_report(report) -> str`` (table + one-line summary last),
``bytes_per_token(model, context) -> int``, ``copy_bandwidth(device) -> float`` (B/s).
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from exl3cli.engine.layers.cpu_exl3 import CpuExl3Linear
from exl3cli.engine.layers.linear import DenseLinear, Exl3Linear
from exl3cli.engine.layers.norm import RMSNorm

GIB = 2**30
MEMORY_PREFILL_CHUNK = 512  # the generator's default prompt chunk


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], Any], device: torch.device) -> float:
    """Seconds `fn` takes on `device` (CUDA events around it; queued work drained first)."""
    _sync(device)
    if device.type != "cuda":
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    fn()
    end.record()
    end.synchronize()
    return begin.elapsed_time(end) / 1e3


def copy_bandwidth(device: torch.device) -> float:
    """Device copy rate in bytes/s, counting bytes read plus bytes written."""
    size = GIB if device.type == "cuda" else 64 * 2**20
    src = torch.empty(size, dtype=torch.uint8, device=device)
    src.random_(0, 255)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    reps = 10 if device.type == "cuda" else 3

    def copies() -> None:
        for _ in range(reps):
            dst.copy_(src)

    seconds = timed(copies, device)
    return 2 * size * reps / seconds


def _nbytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


def _own_buffer_bytes(module: torch.nn.Module) -> int:
    return sum(_nbytes(b) for b in module.buffers(recurse=False))


def bytes_per_token(model: Any, context: int) -> int:
    """Bytes one batch-1 decode step must read at `context` cached positions: every
    linear as stored (trellis + scales, or the dense matrix), norms, one embedding row,
    and the keys and values of every layer."""
    total = 0
    for module in model.modules():
        if isinstance(module, Exl3Linear):
            if module.mode == "trellis":
                scales = [getattr(module, n, None) for n in ("suh32", "svh32", "bias32")]
                if scales[0] is None:
                    scales = [module.suh, module.svh, module.bias]
                total += _nbytes(module.trellis) + sum(_nbytes(s) for s in scales)
            else:
                total += _own_buffer_bytes(module)
        elif isinstance(module, CpuExl3Linear):  # the CPU's exl3 mode: trellis as stored
            total += module.nbytes
        elif isinstance(module, (DenseLinear, RMSNorm)):
            total += _own_buffer_bytes(module)  # whatever form the layer holds its weight in
    config = model.config
    element = torch.empty(0, dtype=model.dtype).element_size()
    total += config.hidden_size * element
    total += 2 * len(model.layers) * config.num_kv_heads * config.head_dim * context * element
    return total


def _weights_bytes(model: Any) -> int:
    seen: set[int] = set()
    total = 0
    for tensor in list(model.buffers()) + list(model.parameters()):
        key = tensor.untyped_storage().data_ptr()
        if key not in seen:  # tied weights share storage
            seen.add(key)
            total += tensor.untyped_storage().nbytes()
    return total


def _workspace_estimate(model: Any, rows: int) -> int:
    """Stated overhead of a prefill chunk of `rows` tokens: the largest per-layer
    working set of the EXL3 GEMM (decoded fp16 weight above 32 rows, fp16 rotated input,
    fp32 accumulator, output) plus the block's activations (residual, normed input,
    gate|up output and its product) and the logits of the last row."""
    config = model.config
    element = torch.empty(0, dtype=model.dtype).element_size()
    gemm = 0
    for module in model.modules():
        if isinstance(module, Exl3Linear) and module.mode == "trellis" and module is not model.lm_head:
            decoded = module.padded_in * module.padded_out * 2 if rows > 32 else 0
            gemm = max(gemm, decoded + rows * (module.padded_in * 2 + module.padded_out * 6))
    inter = config.intermediate_size
    activations = rows * element * (3 * config.hidden_size + 3 * inter)
    return gemm + activations + config.vocab_size * 4 * 2


def _random_prompts(gen: torch.Generator, vocab: int, rows: int, length: int) -> list[list[int]]:
    # Fresh ids every run, from the low half of the vocabulary (no special tokens), so
    # no run takes its prompt from the prefix cache of an earlier one.
    return torch.randint(10, max(11, vocab // 2), (rows, length), generator=gen).tolist()


class _Generators:
    """One generator per (batch, context), kept across runs as a server keeps it: the
    CUDA graphs of its decode buckets are captured once, in the first run."""

    def __init__(self, model: Any, tokenizer: Any, mode: str | None):
        self.model, self.tokenizer, self.mode = model, tokenizer, mode
        self._made: dict[tuple[int, int], Any] = {}

    def get(self, batch: int, context: int, prefill: int) -> Any:
        from exl3cli.engine.generation.generator import Generator

        key = (batch, context)
        if key not in self._made:
            self._made.clear()  # one pool at a time
            self._made[key] = Generator(self.model, self.tokenizer, max_batch=batch,
                                        num_ctx=context, decode_mode=self.mode,
                                        max_prefill_tokens=prefill, max_queue=batch)
        return self._made[key]


def _run_jobs(generator: Any, prompts: list[list[int]], gen_tokens: int
              ) -> tuple[float, float, int]:
    """(prefill seconds, decode seconds, decode steps) of one batch of greedy jobs
    through the generator: the prompt steps, then the steps that only decode."""
    from exl3cli.engine.generation.jobs import GenerationJob

    device = torch.device(generator.model.device)
    for ids in prompts:  # the prompt step samples the first token: gen_tokens steps follow
        generator.submit(GenerationJob(ids, {"temperature": 0}, num_predict=gen_tokens + 1,
                                       ignore_eos=True))
    _sync(device)
    start = time.perf_counter()
    while generator.prefilling:
        generator.step()
    _sync(device)
    prefilled = time.perf_counter()
    steps = 0
    while generator.has_work:
        steps += 1 if generator.step().decode_tokens else 0
    _sync(device)
    return prefilled - start, time.perf_counter() - prefilled, steps


def _measure_pair(generators: _Generators, gen: torch.Generator, batch: int, length: int,
                  gen_tokens: int) -> tuple[dict, dict]:
    generator = generators.get(batch, length + gen_tokens + 9, batch * length)
    vocab = generators.model.config.vocab_size
    runs = [_run_jobs(generator, _random_prompts(gen, vocab, batch, length), gen_tokens)
            for _ in range(2)]  # the first run: allocator, cuBLAS heuristics, graphs
    prefill, decode, steps = runs[-1]
    prompt = {"batch": batch, "tokens": length, "seconds": prefill,
              "tok_s": batch * length / prefill}
    generation = {"batch": batch, "context": length, "tokens": steps,
                  "seconds": decode, "tok_s": batch * steps / decode,
                  "tok_s_per_row": steps / decode, "ms_per_step": 1e3 * decode / steps}
    return prompt, generation


def _memory_run(generators: _Generators, context: int, gen: torch.Generator) -> dict:
    """Peak allocated memory of one sequence in a `context`-token cache: a prompt of
    up to 2048 tokens in 512-token chunks, then 16 decode steps."""
    model = generators.model
    device = model.device
    generators._made.clear()
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    generator = generators.get(1, context, MEMORY_PREFILL_CHUNK)
    pool = generator.pool
    cache_bytes = sum(_nbytes(t) for layer in (*pool.keys, *pool.values)
                      for t in (layer if isinstance(layer, tuple) else (layer,)))
    length = max(1, min(2048, context - 17))
    prompts = _random_prompts(gen, model.config.vocab_size, 1, length)
    _run_jobs(generator, prompts, min(16, context - length))
    peak = torch.cuda.max_memory_allocated(device)
    weights = _weights_bytes(model)
    workspace = _workspace_estimate(model, min(MEMORY_PREFILL_CHUNK, length))
    expected = weights + cache_bytes + workspace
    generators._made.clear()
    return {"context": context, "prompt_tokens": length, "peak_bytes": peak,
            "allocated_before_bytes": before, "weights_bytes": weights,
            "cache_bytes": cache_bytes, "stated_workspace_bytes": workspace,
            "expected_bytes": expected, "peak_over_expected": peak / expected,
            "overhead_bytes": peak - weights - cache_bytes}


def run_speed(
    folder: str | Path,
    *,
    prompt_lengths: list[int],
    gen_tokens: int,
    batches: list[int],
    device: str | None = None,
    memory_context: int = 8192,
    graphs: bool = True,
    label: str | None = None,
    seed: int = 0,
) -> dict[str, Any]:
    """Load the model in `folder` and measure it through the generator, the path `run`
    and `serve` take (see the module docstring)."""
    from exl3cli.engine.models.loader import load_causal_lm
    from exl3cli.engine.text.tokenizer import Tokenizer
    from exl3cli.ops import cuda_kernels as kernels

    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    bandwidth = copy_bandwidth(dev)
    start = time.perf_counter()
    model = load_causal_lm(folder, device=dev)
    tokenizer = Tokenizer.from_folder(folder)
    _sync(dev)
    load_seconds = time.perf_counter() - start
    cuda = dev.type == "cuda"
    generators = _Generators(model, tokenizer, None if graphs or not cuda else "static")
    gen = torch.Generator().manual_seed(seed)
    # Warm-up: builds the kernels outside every timed region.
    _measure_pair(generators, gen, 1, min(16, min(prompt_lengths)), 4)
    prompts, generation = [], []
    for batch in batches:
        for length in prompt_lengths:
            prompt, generated = _measure_pair(generators, gen, batch, length, gen_tokens)
            prompts.append(prompt)
            generation.append(generated)
    mode = next(iter(generators._made.values())).decode.mode
    for row in generation:
        if row["batch"] == 1:
            need = bytes_per_token(model, row["context"])
            row["bytes_per_token"] = need
            if dev.type == "cuda":
                # Only a GPU streams every weight from memory each token; on a CPU a small
                # model sits in the caches, so a memory-bandwidth "limit" means nothing
                # there (it read 154% of it).
                row["limit_tok_s"] = bandwidth / need
                row["fraction_of_limit"] = row["tok_s"] / row["limit_tok_s"]
    report: dict[str, Any] = {
        "model": label or str(folder),
        "device": torch.cuda.get_device_name(dev) if cuda else "cpu",
        "dtype": str(model.dtype).removeprefix("torch."),
        "decode_mode": mode,
        "kernels": ("fused" if kernels.available() else "reference") if cuda else "cpu",
        "kernels_reason": kernels.unavailable_reason() if cuda else None,
        "load_seconds": load_seconds,
        "copy_bandwidth_Bps": bandwidth,
        "prompt": prompts,
        "generation": generation,
        "peak_memory_bytes": torch.cuda.max_memory_allocated(dev) if cuda else None,
        "memory": None,
    }
    if cuda and memory_context > 0:
        report["memory"] = _memory_run(generators, memory_context, gen)
    report["summary"] = _summary(report)
    return report


def _summary(report: dict[str, Any]) -> str:
    parts = [f"{report['model']} on {report['device']}"]
    longest = max(report["prompt"], key=lambda r: (r["batch"] == 1, r["tokens"]))
    parts.append(f"prompt {longest['tokens']}x{longest['batch']}: {longest['tok_s']:.0f} tok/s")
    for row in report["generation"]:
        if row is max((r for r in report["generation"] if r["batch"] == row["batch"]),
                      key=lambda r: r["context"]):
            text = f"gen b{row['batch']}@{row['context']}: {row['tok_s']:.1f} tok/s"
            if "fraction_of_limit" in row:
                text += f" ({100 * row['fraction_of_limit']:.0f}% of the bandwidth limit)"
            parts.append(text)
    memory = report.get("memory")
    if memory:
        parts.append(f"peak {memory['peak_bytes'] / GIB:.2f} GiB with a "
                     f"{memory['context']}-token cache")
    elif report.get("peak_memory_bytes"):
        parts.append(f"peak {report['peak_memory_bytes'] / GIB:.2f} GiB")
    return "; ".join(parts)


def format_speed_report(report: dict[str, Any]) -> str:
    """A readable table; the one-line summary last."""
    lines = [f"model     {report['model']}",
             f"device    {report['device']} ({report['dtype']}, decode: "
             f"{report['decode_mode']}, kernels: {report['kernels']})",
             f"copy rate {report['copy_bandwidth_Bps'] / 1e9:.0f} GB/s (read + write)",
             "", "prompt     batch  tokens    tok/s"]
    for row in report["prompt"]:
        lines.append(f"           {row['batch']:>5}  {row['tokens']:>6}  {row['tok_s']:>7.0f}")
    lines += ["", "generate   batch  context  tok/s    ms/step  % of limit"]
    for row in report["generation"]:
        share = f"{100 * row['fraction_of_limit']:.0f}%" if "fraction_of_limit" in row else "-"
        lines.append(f"           {row['batch']:>5}  {row['context']:>7}  {row['tok_s']:>7.1f}"
                     f"  {row['ms_per_step']:>7.2f}  {share:>10}")
    memory = report.get("memory")
    if memory:
        lines += ["", f"memory     {memory['context']}-token cache: peak "
                  f"{memory['peak_bytes'] / GIB:.2f} GiB = weights "
                  f"{memory['weights_bytes'] / GIB:.2f} + cache {memory['cache_bytes'] / GIB:.2f}"
                  f" + overhead {memory['overhead_bytes'] / GIB:.2f} GiB (stated workspace "
                  f"{memory['stated_workspace_bytes'] / GIB:.2f}; peak/expected "
                  f"{memory['peak_over_expected']:.3f})"]
    lines += ["", report["summary"]]
    return "\n".join(lines)
