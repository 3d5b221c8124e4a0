"""CPU prompt and decode speed of the reference engine vs transformers, same weights.

Builds a random-initialised model of SmolLM2-135M's shape in memory (no download), or
loads the Hugging Face folder given with --model (e.g. the real SmolLM2-135M-Instruct),
then measures a 512-token prompt and greedy generation: ours with each CPU weight mode
(float32 activations; "off" = plain F.linear, see engine/loader.resolve_cpu_weights) and
with bfloat16 compute, transformers in float32 and bfloat16. Ours is timed on the
paged cache, one PagedBatch per step, as engine/generation/generator.py runs it. Each figure is the
best of --repeats runs (the machine is shared; the best run is the least disturbed one).
EXL3_NO_EXT=1 times the pure-PyTorch fallback of the CPU kernels.

    python3 bench/cpu_decode.py [--model FOLDER] [--new-tokens 64] [--threads N]
        [--repeats 3] [--modes off,fp32,bf16,int8] [--no-transformers] [--no-bf16-compute]
"""

from __future__ import annotations

import argparse
import time

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from exl3cli.engine.kvcache.paged_attention import PagedBatch
from exl3cli.engine.kvcache.paged_cache import PAGE_SIZE, PagePool, PageTable, pages_for
from exl3cli.engine.models.loader import build_causal_lm, load_causal_lm
from exl3cli.engine.spec.architecture import get_architecture
from exl3cli.engine.spec.config import ModelConfig

SMOLLM2_135M = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "vocab_size": 49152,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_theta": 100000.0,
    "tie_word_embeddings": True,
    "hidden_act": "silu",
}


class StateDictReader:
    """WeightReader stand-in over an in-memory state dict (same get/has methods)."""

    def __init__(self, state: dict[str, torch.Tensor]):
        self.state = state

    def has(self, name: str) -> bool:
        return name in self.state

    def get(self, name, dtype=None, device=None) -> torch.Tensor:
        return self.state[name].to(dtype=dtype, device=device)


def best_of(repeats: int, timer, *args) -> tuple[float, ...]:
    runs = [timer(*args) for _ in range(repeats)]
    return tuple(max(r[i] for r in runs) for i in range(len(runs[0])))


def time_ours(model, prompt: torch.Tensor, new_tokens: int) -> tuple[float, float]:
    """Prompt and generation tok/s over the paged cache, one sequence, one PagedBatch
    per step as engine/generation/generator.py runs it (the terminal chat)."""
    config = model.config
    total = prompt.shape[1] + new_tokens + 1
    pool = PagePool(pages_for(total), len(model.layers), config.num_kv_heads,
                    config.head_dim, model.dtype, model.device)
    table = PageTable(pool)
    ids = prompt[0].tolist()
    if not table.admit(ids, total):
        raise RuntimeError(f"{PAGE_SIZE}-token pages do not fit the run")
    start = time.perf_counter()
    logits = model(prompt, PagedBatch(pool, [table], [ids]), last_logits_only=True)
    prompt_s = time.perf_counter() - start
    token = int(logits[0, -1].argmax())
    start = time.perf_counter()
    for _ in range(new_tokens):
        logits = model(torch.tensor([[token]]), PagedBatch(pool, [table], [[token]]),
                       last_logits_only=True)
        token = int(logits[0, -1].argmax())
    return prompt.shape[1] / prompt_s, new_tokens / (time.perf_counter() - start)


@torch.inference_mode()
def time_transformers(model, prompt: torch.Tensor, new_tokens: int) -> tuple[float, float]:
    start = time.perf_counter()
    model(prompt, use_cache=True, logits_to_keep=1)
    prompt_s = time.perf_counter() - start
    start = time.perf_counter()
    out = model.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                         do_sample=False)
    total_s = time.perf_counter() - start
    decode_s = max(total_s - prompt_s, 1e-9)  # generate() re-runs the prompt first
    return prompt.shape[1] / prompt_s, (out.shape[1] - prompt.shape[1]) / decode_s


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--modes", default="off,fp32,bf16,int8")
    parser.add_argument("--no-transformers", action="store_true")
    parser.add_argument("--no-bf16-compute", action="store_true",
                        help="skip the bfloat16-compute run of ours")
    parser.add_argument("--model", default=None,
                        help="Hugging Face folder to load instead of random weights")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    if args.model:
        reference = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32,
                                                         attn_implementation="sdpa").eval()
        vocab = reference.config.vocab_size

        def build(dtype, mode):
            return load_causal_lm(args.model, "cpu", dtype, cpu_weights=mode)
    else:
        hf_config = LlamaConfig(**{k: v for k, v in SMOLLM2_135M.items() if k != "architectures"})
        hf_config._attn_implementation = "sdpa"
        reference = LlamaForCausalLM(hf_config).eval()
        state = reference.state_dict()
        config = ModelConfig.from_dict(SMOLLM2_135M)
        spec = get_architecture("LlamaForCausalLM")
        vocab = SMOLLM2_135M["vocab_size"]

        def build(dtype, mode):
            return build_causal_lm(config, spec, StateDictReader(state), torch.device("cpu"),
                                   dtype, cpu_weights=mode)
    prompt = torch.randint(0, vocab, (1, args.prompt_tokens))
    print(f"threads={torch.get_num_threads()} prompt={args.prompt_tokens} "
          f"new_tokens={args.new_tokens} weights={args.model or 'random'}")
    runs = [(torch.float32, mode) for mode in args.modes.split(",") if mode]
    if not args.no_bf16_compute:
        runs.append((torch.bfloat16, "off"))
    for dtype, mode in runs:
        ours = build(dtype, mode)
        time_ours(ours, prompt[:, :16], 4)  # warm-up
        ours_prompt, ours_gen = best_of(args.repeats, time_ours, ours, prompt, args.new_tokens)
        name = f"{str(dtype).removeprefix('torch.')}/{mode}"
        print(f"{name:14s} exl3   prompt {ours_prompt:8.1f} tok/s  generation {ours_gen:6.1f} "
              "tok/s", flush=True)
        del ours
    if args.no_transformers:
        return
    for dtype in (torch.float32, torch.bfloat16):
        theirs = reference.to(dtype)
        time_transformers(theirs, prompt[:, :16], 4)
        hf_prompt, hf_gen = best_of(args.repeats, time_transformers, theirs, prompt,
                                    args.new_tokens)
        name = str(dtype).removeprefix("torch.")
        print(f"{name:14s} hf     prompt {hf_prompt:8.1f} tok/s  generation {hf_gen:6.1f} tok/s",
              flush=True)

if __name__ == "__main__":
    main()
