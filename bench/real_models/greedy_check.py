"""Greedy text of a real model on one device, against a reference run on another.

`reference` runs the model folder on a device (the CPU reference path: float32 on the
CPU) through the generator `exl3 run` uses (chat template, temperature 0, 64 new
tokens), then scores the reference's own tokens in one teacher-forced pass and keeps,
per generated position, the top-5 next-token logits. `check` runs the same prompts on
another device/dtype, compares the token ids with the reference JSON and, at the first
divergent position, reports the logit gap that explains it:

- ``ref_gap``: in the reference's logits at that position, logit(reference token) -
  logit(token the checked run chose) (from the stored top-5; None if it is not there);
- ``own_gap``: in the checked run's teacher-forced logits over the reference's prefix,
  logit(its own token) - logit(the reference token).

A divergence counts as explained when ``ref_gap`` is below ``--gap`` (1e-2): the two
candidates were tied to within float-order noise in the reference itself. Every prompt
also gets ``noise_p50`` / ``noise_max``: the checked run's own logit error on the
reference's text (teacher-forced, over the reference's top-5 tokens at each position),
and a divergence ``within_noise`` when ``ref_gap`` is below that run's ``noise_max``.

    python bench/real_models/greedy_check.py reference FOLDER --device cpu --out ref.json
    python bench/real_models/greedy_check.py check FOLDER --ref ref.json --device cuda \
        --dtype float16 --out check.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

PROMPTS = [
    "Name three primary colours and say one thing about each.",
    "Write a short poem about the sea.",
    "Explain in two sentences what a compiler does.",
]
# For base models (--raw): plain text to continue, encoded with the model's BOS.
RAW_PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village by the sea,",
    "A compiler is a program that",
]
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _load(folder: str, device: str, dtype: str | None, max_batch: int = 4) -> Any:
    from exl3cli.api import load

    return load(folder, device=device, dtype=DTYPES[dtype] if dtype else None,
                max_seq_len=512, max_batch=max_batch)


def _prompt_ids(llm: Any, prompt: str, raw: bool) -> list[int]:
    if raw:
        return list(llm.tokenizer.encode(prompt))
    return list(llm.text_model.chat_prompt([{"role": "user", "content": prompt}]))


def _generate(llm: Any, ids: list[int], tokens: int) -> list[int]:
    job = llm.submit(ids, max_tokens=tokens, temperature=0)
    job.text()
    return list(job.token_ids)


@torch.inference_mode()
def _forced_logits(llm: Any, ids: list[int]) -> torch.Tensor:
    """Next-token logits [len(ids), V] after each prefix, in one pass (no cache)."""
    model = llm.model
    tensor = torch.tensor([ids], dtype=torch.long, device=model.device)
    return model.forward(tensor)[0].float().cpu()


def reference(args: argparse.Namespace) -> dict:
    llm = _load(args.folder, args.device, args.dtype)
    rows = []
    for prompt in (RAW_PROMPTS if args.raw else PROMPTS)[: args.prompts]:
        ids = _prompt_ids(llm, prompt, args.raw)
        start = time.perf_counter()
        out = _generate(llm, ids, args.tokens)
        seconds = time.perf_counter() - start
        logits = _forced_logits(llm, ids + out)[len(ids) - 1 : len(ids) - 1 + len(out)]
        top = torch.topk(logits, 5, dim=-1)
        rows.append({
            "prompt": prompt, "prompt_ids": ids, "ids": out,
            "text": llm.tokenizer.decode(out),
            "top_ids": top.indices.tolist(),
            "top_logits": [[round(v, 5) for v in r] for r in top.values.tolist()],
            # forced pass agrees with the generator's own choice at every position?
            "forced_argmax_agrees": [int(i) for i in (top.indices[:, 0] == torch.tensor(out))
                                     .tolist()].count(1) == len(out),
            "seconds": round(seconds, 2),
        })
    return {"folder": str(args.folder), "device": args.device, "dtype": str(llm.model.dtype),
            "tokens": args.tokens, "raw": args.raw, "prompts": rows}


def _gap_in_reference(row: dict, position: int, token: int) -> float | None:
    ids, values = row["top_ids"][position], row["top_logits"][position]
    if token not in ids:
        return None
    return values[0] - values[ids.index(token)]


def _noise(forced: torch.Tensor, row: dict) -> dict[str, float]:
    """This run's logit error against the reference, on the reference's own text: at
    every generated position (`forced`: this run's teacher-forced logits there),
    |own logit - reference logit| over the reference's top-5 tokens. Its median and
    maximum say how far apart two candidates must be for this dtype and device to keep
    the reference's order."""
    top = torch.tensor(row["top_ids"])
    diff = (forced.gather(1, top) - torch.tensor(row["top_logits"])).abs().flatten()
    return {"noise_p50": round(float(diff.median()), 5), "noise_max": round(float(diff.max()), 5)}


def check(args: argparse.Namespace) -> dict:
    ref = json.loads(Path(args.ref).read_text())
    llm = _load(args.folder, args.device, args.dtype)
    results = []
    for row in ref["prompts"][: args.prompts]:
        ids = _prompt_ids(llm, row["prompt"], ref.get("raw", False))
        if ids != row["prompt_ids"]:
            results.append({"prompt": row["prompt"], "status": "FAIL: prompt tokens differ"})
            continue
        out = _generate(llm, ids, len(row["ids"]))
        want = row["ids"]
        first = next((i for i, (a, b) in enumerate(zip(out, want, strict=False)) if a != b),
                     None)
        if first is None and len(out) != len(want):
            first = min(len(out), len(want))
        # one teacher-forced pass over the reference's text: the noise, and the logits
        # at a divergence (each position sees only the reference's tokens before it)
        forced_all = _forced_logits(llm, ids + want)[len(ids) - 1 : len(ids) - 1 + len(want)]
        entry: dict[str, Any] = {"prompt": row["prompt"], "text": llm.tokenizer.decode(out),
                                 "same_tokens": first is None, "first_divergence": first,
                                 "tokens": len(out), **_noise(forced_all, row)}
        if first is not None and first < min(len(out), len(want)):
            mine, theirs = out[first], want[first]
            forced = forced_all[first]
            entry.update({
                "ref_token": theirs, "own_token": mine,
                "ref_gap": _gap_in_reference(row, first, mine),
                "own_gap": round(float(forced[mine] - forced[theirs]), 5),
                "own_forced_argmax": int(torch.argmax(forced)),
            })
            gap = entry["ref_gap"]
            entry["explained"] = gap is not None and gap < args.gap
            # closer than this run's own logit error on the reference's text: a tie
            # that the float order decides, whatever the bar
            entry["within_noise"] = gap is not None and gap < entry["noise_max"]
        results.append(entry)
    same = sum(r.get("same_tokens", False) for r in results)
    explained = sum(bool(r.get("explained")) for r in results)
    return {"folder": str(args.folder), "device": args.device, "dtype": str(llm.model.dtype),
            "reference": {"device": ref["device"], "dtype": ref["dtype"]},
            "same": same, "explained": explained, "prompts": len(results),
            "ok": same + explained == len(results), "results": results}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=["reference", "check"])
    parser.add_argument("folder")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                        help="default: the loader's (float32 on CPU, the checkpoint's on GPU)")
    parser.add_argument("--ref", help="reference JSON (check mode)")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--prompts", type=int, default=len(PROMPTS))
    parser.add_argument("--gap", type=float, default=1e-2)
    parser.add_argument("--raw", action="store_true",
                        help="continue plain text (base models) instead of a chat turn")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    if args.mode == "check" and not args.ref:
        parser.error("check needs --ref")
    report = reference(args) if args.mode == "reference" else check(args)
    Path(args.out).write_text(json.dumps(report, indent=1))
    if args.mode == "check":
        print(f"{Path(args.folder).name} {args.device} {report['dtype']}: "
              f"{report['same']}/{report['prompts']} same, {report['explained']} explained")
        return 0 if report["ok"] else 1
    print(f"{Path(args.folder).name} reference on {args.device}: "
          + " | ".join(r["text"][:40].replace("\n", " ") for r in report["prompts"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
