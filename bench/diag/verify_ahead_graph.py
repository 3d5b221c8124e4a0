"""Which variant of tests/engine/test_ahead_step_cuda.py's verify-ahead test parts from
the plain greedy tokens on the GPU (graph steps): EXL3_VERIFY_AHEAD on/off, prompts
beside decode rows on/off, the first and second round on one generator, async steps
on/off. Prints, per variant, the jobs that differ and where (first position).

    python3 bench/diag/verify_ahead_graph.py      (a CUDA machine; synthetic tiny model)
"""

from __future__ import annotations

import os
import random
import tempfile
from pathlib import Path

import torch

from exl3cli.convert.synthetic import write_synthetic_model
from exl3cli.engine.generation.generator import Generator
from exl3cli.engine.generation.jobs import GenerationJob
from exl3cli.engine.models.loader import load_causal_lm
from exl3cli.engine.text.tokenizer import Tokenizer
from tests.fixtures.drafters import OracleDrafter

GREEDY = {"temperature": 0}


def first_diff(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def main() -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    mode = "graph" if device == "cuda" else "static"
    folder = write_synthetic_model(Path(tempfile.mkdtemp()), "tiny", bits=4.0, seed=3)
    model = load_causal_lm(folder, device=device, dtype=torch.float32)
    tokenizer = Tokenizer.from_folder(folder)
    rng = random.Random(12)
    vocab = model.config.vocab_size
    prompts = [[rng.randrange(10, vocab // 2) for _ in range(rng.choice([3, 40, 255, 300]))]
               for _ in range(4)]

    def generator(env: dict[str, str], async_step: bool = True) -> Generator:
        for key, value in env.items():
            os.environ[key] = value
        return Generator(model, tokenizer, decode_mode=mode, num_ctx=1024, max_batch=4,
                         async_step=async_step)

    def run(g: Generator, drafting: bool, answers=None) -> list[list[int]]:
        jobs = [GenerationJob(p, GREEDY, num_predict=40, ignore_eos=True,
                              **({"draft_tokens": 3, "drafter": OracleDrafter(p, a)}
                                 if drafting else {}))
                for p, a in zip(prompts, answers or [[]] * len(prompts), strict=True)]
        handles = [g.submit(job) for job in jobs]
        g.run_until_done()
        return [h.token_ids for h in handles]

    plain = run(generator({"EXL3_PROMPT_BESIDE": "0", "EXL3_VERIFY_AHEAD": "0"}, False), False)
    print("prompt lengths", [len(p) for p in prompts])
    # A second round on one generator without drafts: do its batches (the 300-token
    # prompts' first pages cached by then) alone move a job off `plain`?
    g = generator({"EXL3_PROMPT_BESIDE": "1", "EXL3_VERIFY_AHEAD": "1"}, True)
    for round_ in (1, 2):
        got = run(g, False)
        print(f"plain graph round {round_}:", [first_diff(x, y) for x, y in zip(got, plain, strict=True)])
        for job, (x, y) in enumerate(zip(got, plain, strict=True)):
            at = first_diff(x, y)
            if at is None:
                continue
            # the teacher-forced logits there (whole sequence, general path): a near tie?
            ids = torch.tensor([prompts[job] + y[:at]], device=device)
            logits = model.forward(ids)[0][-1].float()
            top = torch.topk(logits, 2)
            print(f"  job {job} at {at}: plain {y[at]} got {x[at]}; top-2 {top.indices.tolist()}"
                  f" gap {float(top.values[0] - top.values[1]):.2e}; logit of got "
                  f"{float(top.values[0] - logits[x[at]]):.2e} below the top")
    for beside in ("0", "1"):
        g = generator({"EXL3_PROMPT_BESIDE": beside, "EXL3_VERIFY_AHEAD": "0"}, False)
        got = run(g, False)
        print(f"plain beside={beside} sync:", [first_diff(x, y) for x, y in zip(got, plain, strict=True)])
    for beside in ("0", "1"):
        for ahead in ("0", "1"):
            for async_step in (False, True):
                g = generator({"EXL3_PROMPT_BESIDE": beside, "EXL3_VERIFY_AHEAD": ahead},
                              async_step)
                for round_ in (1, 2):
                    got = run(g, True, plain)
                    print(f"drafts beside={beside} verify_ahead={ahead} async={async_step} "
                          f"round {round_}:", [first_diff(x, y) for x, y in zip(got, plain, strict=True)],
                          "before_text", g.launched_before_text, "ahead", g.launched_ahead)


if __name__ == "__main__":
    main()
