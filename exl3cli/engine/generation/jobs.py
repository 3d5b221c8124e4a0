"""Jobs of the batched generator: what a caller submits, the handle it gets back, and
the per-job state the generator advances one step at a time.

A job's events are `TextEvent`s (text_events.py: text deltas cut
at stop strings, then one `done` event with Ollama's counters) plus
`prompt_cache_count`, the prompt tokens taken from the prefix cache. In the done
event `prompt_eval_count` counts the prompt tokens actually evaluated (the rest), as
Ollama reports it.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from exl3cli.engine.generation.batch_sampling import batchable
from exl3cli.engine.generation.draft_policy import DraftBackoff
from exl3cli.engine.generation.sampling import Sampler, build_sampler
from exl3cli.engine.generation.speculative import verify, verify_picks
from exl3cli.engine.generation.text_events import StopStringMatcher, TextEvent
from exl3cli.engine.kvcache.paged_cache import PageTable
from exl3cli.engine.text.tokenizer import Tokenizer


class JobDriver(Protocol):
    """What a handle needs of its generator (generator.Generator): no import back."""

    background: bool

    def step(self) -> Any: ...

    def cancel(self, handle: JobHandle) -> None: ...


@dataclass
class GenerationJob:
    """One request: prompt token ids, sampler options, stop conditions and limits.

    `num_predict` < 0 means until EOS / stop string / context end. `num_ctx` (at most
    the generator's) limits this job's context. A prompt that does not fit raises
    ContextOverflow at submit, unless `truncate` is set: then the prompt keeps its
    first `num_keep` tokens and its most recent ones, half a context in all.
    """

    prompt_ids: Sequence[int]
    options: dict[str, Any] | None = None
    stop: Sequence[str] = ()
    num_predict: int = -1
    num_ctx: int | None = None
    truncate: bool = False
    num_keep: int = 0
    sampler: Sampler | None = None  # a prebuilt sampler wins over `options`
    # Structured output (engine/grammar/constraints.py): masks logits before each sample and
    # ends the job once its value is complete. Stateful: one object per job.
    constraint: Any = None
    # Speculative decoding (engine/generation/speculative.py): a Drafter proposing up to
    # `draft_tokens` tokens per step, verified in the step's one forward pass.
    drafter: Any = None
    draft_tokens: int = 0
    # Benchmarks: EOS does not end the job (it runs to num_predict, as the peers'
    # min_new_tokens does); stop strings still apply.
    ignore_eos: bool = False
    # A LoRA adapter loaded on the model (engine/adapters/lora.py) for this job's rows; None: the
    # base model.
    adapter: str | None = None
    # Where the events go instead of the handle's queue: a wake.WakeBatcher (the daemon
    # takes every job's events of a step at once); None: the handle's own queue.
    sink: Any = None


@dataclass
class GeneratorEvent(TextEvent):
    """TextEvent plus the number of prompt tokens reused from the prefix cache, and
    (speculative decoding) the draft tokens verified and how many of them were kept."""

    prompt_cache_count: int = 0
    draft_count: int = 0
    draft_accepted: int = 0


class JobHandle:
    """What submit() returns: iterate it for events, or call text(); cancel() stops it.

    Iterating drives the generator when no background thread runs it, so a single
    thread can consume several handles in turn; an abandoned iteration cancels the job.
    """

    def __init__(self, generator: JobDriver, job: GenerationJob, job_id: int,
                 prompt: list[int]):
        self.generator = generator
        self.job = job
        self.id = job_id
        self.prompt = prompt  # the prompt ids the job runs on (after any truncation)
        self.error: BaseException | None = None  # a failure of the generator itself
        self.events: queue.Queue[GeneratorEvent] = queue.Queue()
        self.sink = job.sink  # set: events go there instead (wake.WakeBatcher)
        self.final: GeneratorEvent | None = None  # set when the job ends
        self.token_ids: list[int] = []  # generated tokens (EOS excluded)

    @property
    def done(self) -> bool:
        return self.final is not None

    def __iter__(self) -> Iterator[GeneratorEvent]:
        return self.iter_events()

    def iter_events(self, cancel: threading.Event | None = None,
                    poll_s: float = 0.05) -> Iterator[GeneratorEvent]:
        """The job's events; setting `cancel` (e.g. from another thread when a client
        goes away) cancels the job within `poll_s` and ends the iteration without a
        done event."""
        finished = False
        try:
            while True:
                if cancel is not None and cancel.is_set():
                    return  # the finally cancels the job
                try:
                    event = self.events.get_nowait()
                except queue.Empty:
                    if not self.generator.background:
                        self.generator.step()
                        continue
                    try:
                        event = self.events.get(timeout=poll_s)  # re-check cancel, thread
                    except queue.Empty:
                        continue
                finished = event.done
                if finished and self.error is not None:
                    raise self.error
                yield event
                if finished:
                    return
        finally:
            if not finished:
                self.cancel()

    def text(self) -> str:
        """Run to the end and return the whole answer."""
        return "".join(event.text for event in self)

    def cancel(self) -> None:
        self.generator.cancel(self)


def special_stop_ids(tokenizer: Tokenizer, stops: Iterable[str]) -> set[int]:
    """Stop strings naming a special token (e.g. "<|im_end|>") stop on its id, because
    special tokens never reach the decoded text."""
    specials = {added.content: token_id
                for token_id, added in tokenizer.backend.get_added_tokens_decoder().items()
                if added.special}
    return {specials[s] for s in stops if s in specials}


@dataclass
class ActiveJob:
    """A job admitted to the generator: its pages, its position, its text state."""

    handle: JobHandle
    table: PageTable
    prompt: list[int]
    sampler: Sampler
    budget: int  # tokens it may still sample in all
    eos_ids: set[int]
    tokenizer: Tokenizer
    stops: list[str]
    cursor: int = 0  # prompt tokens already in the cache
    pending_token: int | None = None  # sampled, to be fed at the next step
    produced: int = 0
    prompt_eval_ns: int = 0
    eval_ns: int = 0
    history: list[int] = field(default_factory=list)
    drafter: Any = None  # Drafter; None: plain decoding
    draft_tokens: int = 0
    drafted: int = 0  # draft tokens fed for verification, and how many were kept
    draft_accepted: int = 0
    # [begin, end) prompt spans fed in one step (an image's tokens attend to each other)
    keep_together: list[tuple[int, int]] = field(default_factory=list)
    _draft: list[int] = field(default_factory=list)  # the drafts fed this step
    # Drafts made for this step by a batched drafter (speculative.prepare_drafts).
    prepared_draft: list[int] | None = None
    backoff: DraftBackoff = field(default_factory=DraftBackoff)  # pauses failing drafts
    _decoder: Any = None
    _matcher: StopStringMatcher | None = None
    _held: list[int] = field(default_factory=list)  # tokens whose text is held back
    _untexted: list[int] = field(default_factory=list)  # taken by `advance`, no text yet
    # Whether its sampler draws with the batch on the device (batch_sampling.batchable;
    # fixed for the job's life, checked once here rather than at every step).
    batched: bool = False

    def __post_init__(self) -> None:
        self.batched = batchable(self.sampler)
        self.cursor = self.table.length
        self.history = list(self.prompt)
        self._decoder = self.tokenizer.incremental_decoder(context_ids=self.prompt)
        self._matcher = StopStringMatcher(self.stops)

    @property
    def prefilling(self) -> bool:
        return self.cursor < len(self.prompt)

    @property
    def verifying(self) -> bool:
        """Whether this step's tokens are the pending token plus drafts to verify."""
        return bool(self._draft)

    def next_tokens(self, prefill_room: int, draft: bool = True) -> list[int]:
        """Tokens to feed this step: the decode token (and any drafts after it, unless
        `draft` is False: the generator times a plain step), or a prompt chunk."""
        if not self.prefilling:
            if self.pending_token is None:
                return []
            if draft:
                self._draft = self._propose()
            else:
                self._draft, self.prepared_draft = [], None
            return [self.pending_token, *self._draft]
        end = self.cursor + prefill_room
        for begin, stop in self.keep_together:
            if begin < end < stop:  # never split a span: stop before it or take it whole
                end = begin if begin > self.cursor else stop
                break
        return self.prompt[self.cursor : end]

    def trim_draft(self, count: int) -> None:
        """Keep only the first `count` drafts of this step (before it is fed)."""
        self._draft = self._draft[:count]

    def draft_budget(self) -> int:
        """How many tokens to draft at this step (0: none; drafting backed off, or no
        room). Call once per step: a backed-off step is counted."""
        count = self.draft_room()
        if self.drafter is None or count <= 0 or not self.backoff.may_draft(self.produced):
            return 0
        return count

    def draft_room(self, ahead: int = 0) -> int:
        """How many tokens a draft may have at the step `ahead` steps from now (no
        back-off counted): every emitted token but the last must fit the reservation,
        k <= budget left - 1."""
        return min(self.draft_tokens, self.budget - self.produced - ahead - 1)

    def _propose(self) -> list[int]:
        prepared, self.prepared_draft = self.prepared_draft, None
        if prepared is not None:
            return prepared
        count = self.draft_budget()
        if count <= 0:
            return []
        return [int(t) for t in self.drafter.propose(self.history, count)][:count]

    def samples_after(self, fed: list[int]) -> bool:
        """Whether the step feeding `fed` ends with a plain sample of this job's logits
        (which the generator may then draw for all such jobs at once): decoding
        without drafts, or the last chunk of the prompt; never with a constraint."""
        if self.handle.job.constraint is not None or self._draft:
            return False
        if self.prefilling:
            return self.cursor + len(fed) >= len(self.prompt) and self.budget > 0
        return True

    def after_forward(self, fed: list[int], logits: torch.Tensor | None,
                      elapsed_ns: int, token: int | None = None,
                      picks: list[int] | None = None) -> list[GeneratorEvent]:
        """Account for a step that fed `fed`; sample when the logits are due (or take
        `token`, sampled by the generator for the whole batch; or, verifying drafts
        greedily, `picks`: the argmax after each fed token, read back for the batch)."""
        if self.prefilling:
            self.cursor += len(fed)
            self.prompt_eval_ns += elapsed_ns
            if self.prefilling:
                return []
            if self.budget <= 0:
                return self.finish("length")
        else:
            self.pending_token = None
            self.eval_ns += elapsed_ns
            if self._draft:
                return self._verify(fed, logits, picks)
        if token is not None:
            return self._take(token)[0]
        return self._sample(logits)

    def _verify(self, fed: list[int], logits: torch.Tensor | None,
                picks: list[int] | None = None) -> list[GeneratorEvent]:
        """`logits` [1 + k, V] after the pending token and each of the k drafts (or a
        greedy sampler's `picks` from them): keep the drafts the sampler agrees with,
        commit them, emit them and one more."""
        draft, self._draft = self._draft, []
        start = time.perf_counter_ns()
        tokens = (verify_picks(draft, picks) if picks is not None
                  else verify(self.sampler, logits, draft, self.history))
        self.eval_ns += time.perf_counter_ns() - start
        kept = len(tokens) - 1
        self.drafted += len(draft)
        self.draft_accepted += kept
        self.table.commit(fed[: 1 + kept])  # rejected drafts' positions get overwritten
        events: list[GeneratorEvent] = []
        for token in tokens:
            more, done = self._take(token)
            events += more
            if done:
                break
        self.backoff.record(len(draft), kept, self.produced)
        return events

    def _sample(self, logits: torch.Tensor) -> list[GeneratorEvent]:
        start = time.perf_counter_ns()
        constraint = self.handle.job.constraint
        if constraint is not None:  # mask first, then let the constraint see the choice
            if constraint.finished:
                return self.finish("stop")
            logits = constraint.mask(logits, self.budget - self.produced)
        token = self.sampler.sample(logits, self.history)
        if constraint is not None:
            token = constraint.accept(token, logits)
        self.eval_ns += time.perf_counter_ns() - start
        return self._take(token)[0]

    def _take(self, token: int) -> tuple[list[GeneratorEvent], bool]:
        """Account for one produced token: its text, and whether the job ended."""
        constraint = self.handle.job.constraint
        self.produced += 1
        if token in self.eos_ids:
            return self.finish("stop"), True
        self.history.append(token)
        self.handle.token_ids.append(token)
        events, stopped = self._text(token)
        if stopped:
            return events + self.finish("stop", flush=False), True
        if self.produced >= self.budget:
            return events + self.finish("length"), True
        if constraint is not None and constraint.finished:
            return events + self.finish("stop"), True  # the value is complete
        self.pending_token = token
        return events, False

    def _text(self, token: int) -> tuple[list[GeneratorEvent], bool]:
        """A taken token's text (held back while it may be part of a stop string), and
        whether a stop string ended with it."""
        self._held.append(token)
        text, stopped = self._matcher.push(self._decoder.push(token))
        if not text:
            return [], stopped
        events = [GeneratorEvent(text=text, token_ids=self._held)]
        self._held = []
        return events, stopped

    # ---- a step's tokens taken before their text (generation/verify_ahead.py) ----------

    def outcome(self, token: int | None, picks: list[int] | None) -> list[int] | None:
        """The tokens a decoding step read back for this job gives it (`token`: its
        plain sample; `picks`: its greedy choices after the pending token and each
        draft), when taking them cannot end the job (no EOS, budget left, no
        constraint); None otherwise (`after_forward` then takes the step)."""
        if self.prefilling or self.handle.job.constraint is not None:
            return None
        if self._draft:
            if picks is None:
                return None
            tokens = verify_picks(self._draft, picks)
        elif token is None:
            return None
        else:
            tokens = [int(token)]
        if self.produced + len(tokens) >= self.budget or self.eos_ids.intersection(tokens):
            return None
        return tokens

    def advance(self, fed: list[int], tokens: list[int], elapsed_ns: int) -> None:
        """Take `tokens` (from `outcome`) into the history, counts and cache as
        `after_forward` would, all but their text (`text_after`, once the next step
        is launched): the next step can be built from it."""
        self.pending_token = None
        self.eval_ns += elapsed_ns
        draft, self._draft = self._draft, []
        if draft:
            kept = len(tokens) - 1
            self.drafted += len(draft)
            self.draft_accepted += kept
            self.table.commit(fed[: 1 + kept])
        self.produced += len(tokens)
        self.history += tokens
        self.handle.token_ids += tokens
        if draft:
            self.backoff.record(len(draft), len(tokens) - 1, self.produced)
        self.pending_token = tokens[-1]
        self._untexted = list(tokens)

    def text_after(self) -> list[GeneratorEvent]:
        """The text of the tokens `advance` took; a stop string among them ends the
        job there, and the tokens after it are taken back (never emitted)."""
        tokens, self._untexted = self._untexted, []
        events: list[GeneratorEvent] = []
        for i, token in enumerate(tokens):
            more, stopped = self._text(token)
            events += more
            if stopped:
                extra = len(tokens) - 1 - i
                if extra:
                    del self.history[-extra:]
                    del self.handle.token_ids[-extra:]
                    self.produced -= extra
                self.pending_token = None
                return events + self.finish("stop", flush=False)
        return events

    def finish(self, reason: str, flush: bool = True,
               cancelled: bool = False) -> list[GeneratorEvent]:
        """The closing events; pages are freed by the generator."""
        events: list[GeneratorEvent] = []
        if flush and not cancelled:
            text, stopped = self._matcher.push(self._decoder.flush())
            text += self._matcher.flush()
            if text:
                events.append(GeneratorEvent(text=text, token_ids=self._held))
            if stopped:
                reason = "stop"
        reused = self.table.reused_tokens
        events.append(GeneratorEvent(
            done=True, done_reason=reason, cancelled=cancelled,
            prompt_eval_count=min(self.cursor, len(self.prompt)) - reused,
            prompt_eval_duration=self.prompt_eval_ns,
            eval_count=self.produced, eval_duration=self.eval_ns,
            prompt_cache_count=reused,
            draft_count=self.drafted, draft_accepted=self.draft_accepted,
        ))
        return events


def build_job_sampler(job: GenerationJob) -> Sampler:
    return job.sampler if job.sampler is not None else build_sampler(job.options)
