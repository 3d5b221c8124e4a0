"""When a job drafts: speculative decoding backs off by itself while drafts are rejected.

A verification pass that keeps none of its drafts costs more than a plain step and
still emits one token, so a job whose drafts keep failing (free text under the
`ngram` drafter, a draft model that disagrees with the target) should stop drafting.
`DraftBackoff` keeps a running acceptance rate (kept / drafted, an exponential average
over verification passes); when it falls below `min_rate` the job decodes plainly for
a pause of `pause` tokens, after which one probe pass drafts again. Each failed probe
doubles the pause (up to `max_pause`); a probe that brings the rate back ends the
back-off. Paused steps are plain one-token steps, so they also take the generator's
fast decode path.

Public API: ``DraftBackoff(min_rate, first_pause, max_pause)`` with ``may_draft(produced)``,
``record(drafted, kept, produced)``, ``paused_until`` and the counters ``pauses`` /
``paused_tokens``.
"""

from __future__ import annotations

from dataclasses import dataclass

# Below about one kept draft in four a 4-token draft gains less than a verify pass
# costs over a plain step (bench/NOTES-speculative.md: a 5-token pass ~1.4x a plain one).
DEFAULT_MIN_RATE = 0.25
DEFAULT_FIRST_PAUSE = 8
DEFAULT_MAX_PAUSE = 128
SMOOTHING = 0.5  # weight of the newest pass in the running rate


@dataclass
class DraftBackoff:
    """Per-job drafting switch; positions are counted in the job's produced tokens."""

    min_rate: float = DEFAULT_MIN_RATE
    first_pause: int = DEFAULT_FIRST_PAUSE
    max_pause: int = DEFAULT_MAX_PAUSE
    rate: float = 1.0  # running acceptance; optimistic start so the first drafts run
    paused_until: int = 0  # no drafts before this many tokens were produced
    pause: int = 0  # the current pause length (0: not backing off)
    pauses: int = 0  # how many times drafting was paused
    paused_tokens: int = 0  # tokens produced without drafting because of a pause

    def may_draft(self, produced: int) -> bool:
        """Whether the job may draft at the step after `produced` tokens."""
        if produced < self.paused_until:
            self.paused_tokens += 1
            return False
        return True

    def record(self, drafted: int, kept: int, produced: int) -> None:
        """A verification pass kept `kept` of `drafted` drafts; `produced` counts the
        job's tokens after it."""
        if drafted <= 0:
            return
        self.rate = (1 - SMOOTHING) * self.rate + SMOOTHING * (kept / drafted)
        if self.rate >= self.min_rate:
            self.pause = 0  # drafting pays again
            return
        self.pause = min(self.max_pause, self.pause * 2 if self.pause else self.first_pause)
        self.paused_until = produced + self.pause
        self.pauses += 1
        # The probe after the pause is judged on its own: start it from the threshold.
        self.rate = self.min_rate
