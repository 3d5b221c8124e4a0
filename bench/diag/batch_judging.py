"""How `draft_policy.judge_batch` sees a batch of 16 n-gram drafting jobs of one prompt
set: per drafted pass, (jobs verifying, drafts kept / drafted, tokens taken off the
slowest job's rest, plain-step time / pass time, the batch pauses after it). On a CPU
(static fixed-shape steps) the times are not the GPU's, but which jobs draft and keep
is the same greedy text's.

    PYTHONPATH=. python bench/diag/batch_judging.py SMOLLM2_FOLDER grounded,free
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from exl3cli.engine.generation import draft_policy
from exl3cli.engine.generation.generator import Generator
from exl3cli.engine.generation.jobs import GenerationJob
from exl3cli.engine.generation.speculative import make_drafter
from exl3cli.engine.generation.textmodel import TextModel

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "real_models"))
from speculative_bench import SETS  # noqa: E402


def main(folder: str, sets: str) -> None:
    torch.set_num_threads(1)
    text_model = TextModel.load(folder, device="cpu", dtype=torch.float32)
    log: list[tuple] = []
    judge = draft_policy.judge_batch

    def spy(clock, fed, took, before, plain, queued=True):
        pairs = list(zip(fed, before, strict=True))
        longest = max(active.budget - produced for (active, _), (produced, _) in pairs)
        left = max(active.budget - active.produced for active, _ in fed)
        kept = sum(max(0, active.produced - produced - 1)
                   for (active, _), (produced, verifying) in pairs if verifying)
        drafts = sum(len(tokens) - 1 for (_, tokens), (_, verifying) in pairs if verifying)
        judge(clock, fed, took, before, plain, queued)
        log.append((sum(verifying for _, verifying in before), f"{kept}/{drafts}",
                    longest - left, round(plain / took, 2) if plain else None,
                    dict(clock._batch_pause)))

    draft_policy.judge_batch = spy
    for name in sets.split(","):
        asks = [text_model.chat_prompt([{"role": "user", "content": a}]) for a in SETS[name]]
        log.clear()
        generator = Generator(text_model.model, text_model.tokenizer, max_batch=16,
                              num_ctx=1024, decode_mode="static")
        handles = [generator.submit(GenerationJob(
            asks[i % len(asks)], {"temperature": 0}, num_predict=64, ignore_eos=True,
            drafter=make_drafter("ngram"), draft_tokens=4)) for i in range(16)]
        generator.run_until_done()
        print(name, "kept", sum(h.final.draft_accepted for h in handles),
              "drafted", sum(h.final.draft_count for h in handles))
        for row in log:
            print("  ", row)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "grounded,free")
