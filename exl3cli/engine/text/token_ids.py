"""Token ids from outside the engine (a request's `context`, a caller's prompt ids) are
checked here before they reach a shared batch: one id past the embedding table would
fail the whole batched forward pass, and with it every other job in that step."""

from __future__ import annotations

from collections.abc import Iterable

from exl3cli.errors import InvalidOption


def check_token_ids(ids: Iterable[object], vocab_size: int, what: str = "token id") -> list[int]:
    """`ids` as a list of ints, each in [0, vocab_size); InvalidOption (a 400) naming the
    first id that is not."""
    checked: list[int] = []
    for index, value in enumerate(ids):
        if isinstance(value, bool):
            raise InvalidOption(f"{what} {index} is not an integer: {value!r}")
        if not isinstance(value, int):
            try:
                number = int(value)  # numpy / torch integers
            except (TypeError, ValueError):
                raise InvalidOption(f"{what} {index} is not an integer: {value!r}") from None
            if number != value:
                raise InvalidOption(f"{what} {index} is not an integer: {value!r}")
            value = number
        if not 0 <= value < vocab_size:
            raise InvalidOption(f"{what} {index} is {value}, outside the model's vocabulary "
                                f"of {vocab_size} tokens")
        checked.append(value)
    return checked
