"""The forward pass of one generator step that is not launched ahead (generator.py).

Which path a step's fed tokens take: the fixed-shape decode runner (decode_step.py) for
one token per decoding job, for a verification pass whose rows fit one step, for a
prompt's last tokens beside decoding jobs (`prompt_beside`), and, in batch-invariant
mode, for any step (invariant.py); otherwise the general paged forward
(`PagedBatch`, or `VerifyingBatch` when jobs verify drafts). Also the one read-back of
a step's samples (`sample_rows`) and the LoRA row selection around a forward
(`adapter_rows`).

`fed` is the step's (job, the tokens it feeds) list, in input order.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

import torch

from exl3cli.engine.generation import invariant
from exl3cli.engine.generation.batch_sampling import batchable, sample_and_pick
from exl3cli.engine.generation.speculative import VerifyingBatch
from exl3cli.engine.kvcache.paged_attention import PagedBatch
from exl3cli.envvars import switch

if TYPE_CHECKING:
    from exl3cli.engine.generation.decode_step import DecodeRunner
    from exl3cli.engine.generation.jobs import ActiveJob
    from exl3cli.engine.kvcache.paged_cache import PagePool

Fed = list[tuple["ActiveJob", list[int]]]
PROMPT_BESIDE_ENV = "EXL3_PROMPT_BESIDE"
BESIDE_IN_TURN_ENV = "EXL3_BESIDE_IN_TURN"
# Prompt tokens (a job's still to take in) that ride beside decode rows in chunks; a
# longer prompt takes the general path. 256 = four 64-row steps: on the H200 a 64-row
# graphed step of SmolLM2 is ~3-4 ms against a general-path step's 30-60 ms with decode
# rows beside it.
BESIDE_MAX_PROMPT = 256


def decode_only(decode: DecodeRunner, fed: Fed) -> bool:
    """Whether this step can run on the fixed-shape decode runner."""
    if not decode.enabled:
        return False
    if any(active.prefilling or len(tokens) != 1 for active, tokens in fed):
        return False
    return decode.fits([(active.table, tokens[0]) for active, tokens in fed])


def sample_rows(fed: Fed, logits: torch.Tensor,
                rows: list[Any]) -> tuple[dict[int, int], dict[int, list[int]]]:
    """({index in fed: token} for the jobs whose step ends in a plain sample, {index:
    the argmax after each fed token} for greedy jobs verifying drafts), read back
    together (batch_sampling.sample_and_pick: one read-back for the batch)."""
    due = [i for i, (active, tokens) in enumerate(fed) if active.samples_after(tokens)]
    picking = [i for i, (active, _) in enumerate(fed) if active.verifying
               and active.sampler.greedy and batchable(active.sampler)]
    if not due and not picking:
        return {}, {}
    drawn, picks = sample_and_pick(
        logits, [rows[i] for i in due], [fed[i][0].sampler for i in due],
        [fed[i][0].history for i in due],
        [range(rows[i].start, rows[i].stop) for i in picking])
    return dict(zip(due, drawn, strict=True)), dict(zip(picking, picks, strict=True))


def forward(model: Any, pool: PagePool, decode: DecodeRunner, batch_invariant: bool,
            fed: Fed, beside: bool = False) -> tuple[torch.Tensor, list[Any]]:
    """One forward pass over the fed tokens: (logits, the logits row of each job:
    an index, or a slice of 1 + k rows for a job verifying k drafts). `beside`: short
    prompts may ride beside decode rows (`prompt_beside`)."""
    rows_in = [(active.table, tokens[0]) for active, tokens in fed
               if not active.prefilling and len(tokens) == 1]
    if len(rows_in) == len(fed) and decode.fits(rows_in):
        return decode.run(rows_in), list(range(len(fed)))
    if (verify_fixed(decode, fed) or (batch_invariant and invariant.fits(fed, decode))
            or (beside and prompt_beside(decode, fed))):
        return forward_fixed(decode, fed)
    tables, token_lists = [a.table for a, _ in fed], [t for _, t in fed]
    verifying = [active.verifying for active, _ in fed]
    if any(verifying):
        batch = VerifyingBatch(pool, tables, token_lists, verifying)
        rows: list[Any] = [r if v else r.start
                           for r, v in zip(batch.output_rows, verifying, strict=True)]
    else:
        batch = PagedBatch(pool, tables, token_lists)
        rows = list(range(len(fed)))
    input_ids = torch.tensor([[t for tokens in token_lists for t in tokens]],
                             dtype=torch.long, device=model.device)
    return model.forward(input_ids, batch, last_logits_only=True)[0], rows


def verify_fixed(decode: DecodeRunner, fed: Fed) -> bool:
    """Whether a pass with drafts runs on the fixed-shape runner: every job decodes
    (no prompt chunk) and all their rows fit one step (decode_step.MAX_ROWS)."""
    if any(active.prefilling for active, _ in fed):
        return False
    return decode.fits_feeds([(active.table, tokens) for active, tokens in fed])


def prompt_beside(decode: DecodeRunner, fed: Fed) -> bool:
    """Whether a step that takes prompt tokens beside decoding jobs runs as one
    fixed-shape step anyway (a row per token, as batch-invariant mode runs every step):
    when each prompt it takes from is short (at most BESIDE_MAX_PROMPT tokens still to
    take in: a new job's prompt past its cached prefix, a chat turn), in chunks of the
    rows the step has left (Generator._beside_room), and all rows fit. The general path
    runs ~350 small ops a layer from the host: such a step took 30-60 ms on the H200 for
    SmolLM2 with 16 jobs decoding (a graphed step of 64 rows: ~3-4 ms), so in a
    refilling queue every admission stalled the others. Longer prompts keep the general
    path (one chunk, big GEMMs). EXL3_PROMPT_BESIDE=0 turns this off
    (`prompt_beside_default`, read when a generator is made)."""
    if not decode.enabled:
        return False
    chunks = [active for active, _ in fed if active.prefilling]
    if not chunks or len(chunks) == len(fed) or max(
            prompt_rest([active]) for active in chunks) > BESIDE_MAX_PROMPT:
        return False
    return invariant.fits(fed, decode)


def prompt_rest(jobs: Iterable[ActiveJob]) -> int:
    """Prompt tokens the prefilling ones of `jobs` still have to take in."""
    return sum(len(active.prompt) - active.cursor for active in jobs if active.prefilling)


def prompt_beside_default() -> bool:
    """EXL3_PROMPT_BESIDE: "1" (default) lets a prompt's rest ride beside decode rows."""
    return switch(PROMPT_BESIDE_ENV, True)


def beside_in_turn_default() -> bool:
    """EXL3_BESIDE_IN_TURN: "1" (default) lets several short prompts waiting ride beside
    decode rows one after another (Generator._beside_room); "0": only when all of them
    together are short (session 16's rule, kept for the A/B)."""
    return switch(BESIDE_IN_TURN_ENV, True)


def forward_fixed(decode: DecodeRunner, fed: Fed) -> tuple[torch.Tensor, list[Any]]:
    """A verification pass (or, batch-invariant, any step) as one fixed-shape step: a
    row per fed token. Plain jobs' tokens and prompt chunks are committed here (a
    chunk's logits: its last row); verifying jobs commit what they accept."""
    logits = decode.run_feeds([(active.table, tokens) for active, tokens in fed])
    rows: list[Any] = []
    first = 0
    for active, tokens in fed:
        if active.verifying:
            rows.append(slice(first, first + len(tokens)))
        else:
            rows.append(first + len(tokens) - 1)
            active.table.commit(tokens)
        first += len(tokens)
    return logits, rows


@contextlib.contextmanager
def adapter_rows(model: Any, rows: list[tuple[ActiveJob, int]]) -> Iterator[None]:
    """Around a forward: tell the model's LoRA adapters (engine/adapters/lora.py), if it has
    any, which one each row uses: (job, its token count), in input order."""
    adapters = getattr(model, "adapters", None)
    if adapters is None:
        yield
        return
    adapters.select_rows([active.handle.job.adapter for active, _ in rows],
                         [count for _, count in rows])
    try:
        yield
    finally:
        adapters.release()
