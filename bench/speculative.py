"""Speculative decoding: generation speed with and without a DRAFT, same process.

    python bench/speculative.py MODEL_FOLDER [--draft ngram] [--k 4] [--tokens 96]
        [--rounds 3] [--device cpu]

For each prompt (one that asks to repeat a passage, one to edit it, one free answer),
greedy generation of `--tokens` tokens runs alternately without and with the draft,
`--rounds` times; reported: median tokens/s of each, their ratio, drafts kept /
drafted, forward passes, and whether the texts are identical (they must be).
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from exl3cli.engine.generation.generator import Generator
from exl3cli.engine.generation.jobs import GenerationJob
from exl3cli.engine.generation.speculative import make_drafter
from exl3cli.engine.generation.textmodel import TextModel

PASSAGE = ("The quick brown fox jumps over the lazy dog while the farmer watches from the "
           "porch, and the sun sets slowly behind the old red barn at the edge of the field.")
ASKS = {
    "repeat": f"Repeat this passage exactly: {PASSAGE}",
    "edit": f"Rewrite this passage with 'cat' instead of 'fox' and 'blue' instead of 'red': "
            f"{PASSAGE}",
    "free": "Explain in a few sentences why the sky is blue.",
}


def generate(model: TextModel, prompt: list[int], tokens: int, draft: str | None,
             k: int) -> tuple[list[int], float, int, int, int]:
    """(token ids, generation seconds, decode passes, drafts kept, drafted) for one
    greedy job."""
    generator = Generator(model.model, model.tokenizer, max_batch=1,
                          num_ctx=len(prompt) + tokens + 8)
    job = GenerationJob(prompt, {"temperature": 0}, num_predict=tokens,
                        drafter=make_drafter(draft) if draft else None,
                        draft_tokens=k if draft else 0)
    handle = generator.submit(job)
    passes = 0
    while generator.has_work:
        passes += generator.step().decode_tokens > 0
    final = handle.final
    # The generator's own eval time: decode passes and sampling, not the prompt.
    return (handle.token_ids, final.eval_duration / 1e9, passes, final.draft_accepted,
            final.draft_count)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", type=Path)
    parser.add_argument("--draft", default="ngram")
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--device", default=None)
    args = parser.parse_args(argv)
    model = TextModel.load(args.model, device=args.device)
    print(f"model {args.model} on {model.model.device}, draft {args.draft}, k {args.k}, "
          f"{args.tokens} tokens, median of {args.rounds}")
    for name, ask in ASKS.items():
        text = model.chat_template.render([{"role": "user", "content": ask}])
        prompt = model.tokenizer.encode(text, add_bos=False)
        plain_rates, draft_rates = [], []
        for _ in range(args.rounds):
            ids, seconds, plain_passes, _, _ = generate(model, prompt, args.tokens, None, 0)
            plain_rates.append(len(ids) / seconds)
            drafted_ids, seconds, passes, kept, drafted = generate(
                model, prompt, args.tokens, args.draft, args.k)
            draft_rates.append(len(drafted_ids) / seconds)
        plain, with_draft = statistics.median(plain_rates), statistics.median(draft_rates)
        print(f"{name:7s} plain {plain:7.1f} tok/s  draft {with_draft:7.1f} tok/s  "
              f"ratio {with_draft / plain:5.2f}  kept {kept}/{drafted}  "
              f"passes {passes} vs {plain_passes}  "
              f"identical {drafted_ids == ids}  ({len(ids)} tokens)", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
