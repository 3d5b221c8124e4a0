"""Built-in speculative drafters (registered through the exl3cli entry-point group).

`ngram` (prompt lookup): the job's last n tokens are looked up earlier in its own text
(prompt and answer so far) and what followed them there is proposed. Answers that
quote, summarise or edit their input repeat long stretches of it, and those are
drafted for free: no second model, no extra memory.
"""

from __future__ import annotations

from exl3cli.engine.speculative import Drafter
from exl3cli.errors import InvalidOption
from exl3cli.plugins import hookimpl


class NgramDrafter:
    """Prompt lookup: find the latest earlier occurrence of the text's last n tokens
    (n from `max_ngram` down to `min_ngram`) and propose what followed it."""

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        if not 1 <= min_ngram <= max_ngram:
            raise InvalidOption(f"ngram drafter: need 1 <= min <= max, got {min_ngram}, "
                                f"{max_ngram}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def propose(self, history: list[int], count: int) -> list[int]:
        size = len(history)
        if count <= 0:
            return []
        for n in range(min(self.max_ngram, size - 1), self.min_ngram - 1, -1):
            tail = history[size - n:]
            # Latest match first: recent text predicts what comes next best.
            for start in range(size - n - 1, -1, -1):
                if history[start:start + n] == tail:
                    follow = history[start + n:start + n + count]
                    if follow:
                        return follow
        return []


def _ngram_factory(spec: str) -> Drafter:
    _, _, size = spec.partition(":")
    if not size:
        return NgramDrafter()
    if not size.isdigit() or not 1 <= int(size) <= 8:
        raise InvalidOption(f"DRAFT {spec!r}: use ngram or ngram:N with N in 1..8")
    return NgramDrafter(max_ngram=int(size))



@hookimpl
def exl3_drafters() -> dict:
    return {"ngram": _ngram_factory}
