"""Speculative decoding: draft a few tokens cheaply, verify them in one forward pass.

A drafter proposes up to k tokens that may follow a job's text. The model then runs
over [pending token, draft_1 .. draft_k] in one pass, which gives next-token logits
after each of them; `verify` walks those logits and keeps drafts while the sampler
would have produced them, then emits one token of its own (the correction, or a bonus
token after a fully accepted draft). Drafts are single proposals (a point mass), so
the rule is: accept draft d with probability p(d) under the processed distribution p;
on rejection draw from p with d removed. Each emitted token then has exactly the
distribution plain decoding gives it, and with greedy sampling (p is one-hot at the
argmax) the text is identical token for token.

Drafters come from plugins (`exl3_drafters`, {name: factory(spec) -> Drafter}); the
built-in one (plugins/drafters.py) is `ngram`: prompt lookup.

Public API:
- ``Drafter`` (protocol): ``propose(history: list[int], count: int) -> list[int]``.
- ``make_drafter(spec: str) -> Drafter``: by a plugin's name, e.g. ``"ngram"`` or
  ``"ngram:N"``, else a draft model's store name or folder (the ``model`` drafter);
  ``resolve_draft(spec, model_folder)`` turns a model name into its folder first.
- ``verify(sampler, logits[k+1, V], draft, history) -> list[int]``: the tokens to
  emit, in order: the accepted drafts then one sampled token (1 .. k+1 tokens);
  ``verify_picks(draft, picks)`` the same for a batchable greedy sampler from its
  argmax per row (read back for the whole step at once).
- ``draft_count(options) -> int``: k from ``draft_num_predict`` (default
  ``DEFAULT_DRAFT_TOKENS``; 0 turns speculation off).
- ``VerifyingBatch(pool, tables, new_tokens, verifying)``: the generator's general paged
  step when some rows verify drafts (``output_rows[i]``: row i's logits in the output);
  passes of decoding jobs only run on the fixed-shape step instead
  (decode_step.DecodeRunner.run_feeds).
- ``prepare_drafts(jobs)``: drafts of every job whose drafter drafts in batches
  (``batch_key`` + ``propose_batch(drafters, histories, counts)``, e.g. a draft model:
  one draft forward per drafted position for all its jobs, not one per job), capped
  by `gate` (engine/generation/draft_gate.py: a draft forward too slow to ever pay).
- When a job drafts at all is engine/generation/draft_policy.py's: drafting backs off by itself
  while its drafts are rejected.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from exl3cli.engine.generation.draft_gate import PROBE_DRAFTS, TIME_FIRST
from exl3cli.engine.kvcache.paged_attention import PagedBatch
from exl3cli.errors import InvalidOption

DEFAULT_DRAFT_TOKENS = 4
MAX_DRAFT_TOKENS = 16


class Drafter(Protocol):
    """One per job. It may also have `release()`: the generator calls it when the job
    ends, to free per-job state (a draft model's cache) while the handle lives on; and
    `peek(history, count)`: a cheap guess (a host-side lookup, not a model; no side
    effects) at what `propose` would return, empty for "nothing": with it a job whose
    drafter has nothing keeps the generator's run-ahead decode steps
    (ahead_step._peeks_dry). A wrong guess costs speed, never text."""

    def propose(self, history: list[int], count: int) -> list[int]:
        """Up to `count` tokens that may follow `history` (may be fewer, or none)."""
        ...


def drafter_factories() -> dict[str, Callable[[str], Drafter]]:
    """{name: factory} from the built-in ngram drafter and every drafter plugin."""
    from exl3cli.hookspecs import get_plugin_manager

    factories: dict[str, Callable[[str], Drafter]] = {}
    for result in get_plugin_manager().hook.exl3_drafters():
        factories.update(result or {})
    return factories


def is_drafter_name(spec: str) -> bool:
    """Whether a DRAFT value names a drafter (``ngram``, ``ngram:2``) rather than a
    draft model."""
    name = spec.strip().partition(":")[0].lower()
    return name != "model" and name in drafter_factories()


def resolve_draft(spec: str, model_folder: Callable[[str], Any]) -> str:
    """A DRAFT value ready for `make_drafter`: a drafter name or a folder as they are, a
    model name turned into its folder by `model_folder(name)` (a store lookup)."""
    if is_drafter_name(spec) or os.path.isdir(os.path.expanduser(spec.strip())):
        return spec
    return str(model_folder(spec.strip()))


def make_drafter(spec: str) -> Drafter:
    """The drafter a Modelfile `DRAFT` line names: a drafter's name (``ngram``,
    ``ngram:2``), else a draft model (store name or folder) for the ``model`` drafter."""
    spec = spec.strip()
    factories = drafter_factories()
    if is_drafter_name(spec):
        return factories[spec.partition(":")[0].lower()](spec.lower())
    if "model" not in factories:
        known = ", ".join(sorted(factories))
        raise InvalidOption(f"unknown draft {spec!r} (available: {known})")
    return factories["model"](spec)


def prepare_drafts(jobs: Sequence[Any],
                   gate: Callable[[Any, int], tuple[int | None, int]] | None = None) -> int:
    """Make this step's drafts for the decoding jobs whose drafters batch: the jobs
    of one `batch_key` (one draft model) are drafted by one `propose_batch` call. Each
    job then finds its draft in `prepared_draft` (generator_jobs.ActiveJob).
    `gate(forward_cost, drafting jobs)`, for drafters with a `forward_cost`
    (draft_gate.DraftForwardCost.decide), caps the positions drafted; a cap of 0 pauses
    the group's jobs for the tokens it says.
    Returns the draft forwards' catch-up time (ns; DraftForwardCost.take_catch_up)."""
    groups: dict[Any, list[tuple[Any, int]]] = {}
    catch_up = 0
    for job in jobs:
        drafter = job.drafter
        if (drafter is None or job.prefilling or job.pending_token is None
                or getattr(drafter, "batch_key", None) is None):
            continue
        count = job.draft_budget()
        if count <= 0:
            job.prepared_draft = []
            continue
        groups.setdefault(drafter.batch_key, []).append((job, count))
    for members in groups.values():
        drafters = [job.drafter for job, _ in members]
        cap, pause = _ask_gate(gate, drafters[0], len(members))
        cost = getattr(drafters[0], "forward_cost", None)
        if cap is not None:
            members = [(job, min(count, cap)) for job, count in members]
        if cap == 0:
            for job, _ in members:
                job.prepared_draft = []
                job.backoff.pause_for(job.produced, pause)
            continue
        proposals = drafters[0].propose_batch(
            drafters, [job.history for job, _ in members], [count for _, count in members])
        for (job, count), proposal in zip(members, proposals, strict=True):
            job.prepared_draft = [int(t) for t in proposal][:count]
        if cost is not None:
            catch_up += cost.take_catch_up()
    return catch_up


def _ask_gate(gate: Callable[[Any, int], tuple[int | None, int]] | None, drafter: Any,
              jobs: int) -> tuple[int | None, int]:
    """The gate's (cap, pause) for `jobs` jobs of `drafter` (draft_gate.decide): when it
    asks for a timing first, the drafter's `time_forward(jobs)`, then its verdict (a
    drafter that cannot time a forward alone drafts PROBE_DRAFTS positions instead)."""
    cost = getattr(drafter, "forward_cost", None)
    if gate is None or cost is None:
        return None, 0
    cap, pause = gate(cost, jobs)
    if cap == TIME_FIRST:
        timer = getattr(drafter, "time_forward", None)
        if timer is not None:
            timer(jobs)
            cap, pause = gate(cost, jobs)
        if cap == TIME_FIRST:
            cap = PROBE_DRAFTS
    return cap, pause


def draft_count(options: dict[str, Any] | None) -> int:
    """k from the request's `draft_num_predict` (0 turns speculation off)."""
    value = (options or {}).get("draft_num_predict")
    if value is None:
        return DEFAULT_DRAFT_TOKENS
    try:
        count = int(value)
    except (TypeError, ValueError):
        raise InvalidOption(f"draft_num_predict must be an integer, got {value!r}") from None
    if not 0 <= count <= MAX_DRAFT_TOKENS:
        raise InvalidOption(f"draft_num_predict must be within 0..{MAX_DRAFT_TOKENS}")
    return count


def verify(sampler: Any, logits: torch.Tensor, draft: Sequence[int],
           history: list[int]) -> list[int]:
    """Tokens to emit after a verification pass; see the module docstring.

    `logits[i]` are the next-token logits after the pending token and draft[:i]
    (so there are len(draft) + 1 rows); `history` is the text before the pending
    token's successor, i.e. everything already emitted.
    """
    emitted: list[int] = []
    for i, proposed in enumerate(draft):
        processed = sampler.process(logits[i], history + emitted)
        if sampler.greedy:
            best = int(torch.argmax(processed))
            if best != proposed:
                return [*emitted, best]
            emitted.append(proposed)
            continue
        probs = torch.softmax(processed, dim=-1)
        if not torch.isfinite(probs).all() or float(probs.sum()) <= 0:
            return [*emitted, int(torch.argmax(processed))]
        generator = sampler.generator(probs.device)
        accept = float(torch.rand((), generator=generator, device=probs.device))
        if accept < float(probs[proposed]):
            emitted.append(proposed)
            continue
        # Rejected: the residual distribution is p with the draft token taken out.
        probs[proposed] = 0.0
        if float(probs.sum()) <= 0:
            return [*emitted, int(torch.argmax(processed))]
        token = torch.multinomial(probs / probs.sum(), 1, generator=generator)
        return [*emitted, int(token)]
    return [*emitted, sampler.sample(logits[len(draft)], history + emitted)]


def verify_picks(draft: Sequence[int], picks: Sequence[int]) -> list[int]:
    """`verify` for a greedy sampler that batches (batch_sampling.batchable), given its
    pick after the pending token and each draft (`picks`, len(draft) + 1 argmaxes read
    back for the whole batch at once): the drafts up to the first it disagrees with,
    then its own pick there."""
    for i, proposed in enumerate(draft):
        if int(picks[i]) != int(proposed):
            return [*map(int, draft[:i]), int(picks[i])]
    return [*map(int, draft), int(picks[len(draft)])]


class VerifyingBatch(PagedBatch):
    """A paged step in which some rows verify drafts: for those rows the model returns
    logits at every new position (not just the last), and their tokens are not
    committed by the model: the generator commits only what was accepted, so the
    positions of rejected drafts are simply written over by the next step."""

    def __init__(self, pool: Any, tables: Sequence[Any], new_tokens: Sequence[Sequence[int]],
                 verifying: Sequence[bool]):
        super().__init__(pool, tables, new_tokens)
        self.verifying = list(verifying)
        index: list[int] = []
        self.output_rows: list[slice] = []  # row i's logits in the model's output
        for i, verify_row in enumerate(self.verifying):
            first = len(index)
            if verify_row:
                index.extend(range(self.offsets[i], self.offsets[i + 1]))
            else:
                index.append(self.offsets[i + 1] - 1)
            self.output_rows.append(slice(first, len(index)))
        self._select = torch.tensor(index, dtype=torch.long, device=self.write_slots.device)

    def select_last(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden[:, self._select]

    def advance(self, counts: Sequence[int] | None = None) -> None:
        for table, tokens, verify_row in zip(self.tables, self.new_tokens, self.verifying,
                                             strict=True):
            if not verify_row:
                table.commit(tokens)
