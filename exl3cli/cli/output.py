"""Terminal output for `run` and the REPL: streamed word wrap, Ollama-style stats lines."""

from __future__ import annotations

import shutil
from typing import TextIO

_STAT_LABEL_WIDTH = 22  # "prompt eval duration: " is the longest label


def format_duration(ns: int) -> str:
    """A duration the way Go's time.Duration prints it (`1.5s`, `12.3ms`, `1m2.5s`).

    Ollama users read these lines every day; matching the format keeps scripts that
    scrape them working.
    """
    ns = int(ns)
    if ns == 0:
        return "0s"
    sign = "-" if ns < 0 else ""
    ns = abs(ns)
    if ns < 1_000:
        return f"{sign}{ns}ns"
    if ns < 1_000_000:
        return f"{sign}{_trim_fraction(ns, 1_000)}µs"
    if ns < 1_000_000_000:
        return f"{sign}{_trim_fraction(ns, 1_000_000)}ms"
    hours, rest = divmod(ns, 3_600_000_000_000)
    minutes, rest = divmod(rest, 60_000_000_000)
    text = f"{_trim_fraction(rest, 1_000_000_000)}s"
    if hours or minutes:
        text = f"{minutes}m{text}"
    if hours:
        text = f"{hours}h{text}"
    return sign + text


def _trim_fraction(value: int, unit: int) -> str:
    whole, fraction = divmod(value, unit)
    if not fraction:
        return str(whole)
    digits = len(str(unit)) - 1
    return f"{whole}.{fraction:0{digits}d}".rstrip("0")


def _rate(count: int, duration_ns: int) -> float:
    return count / (duration_ns / 1e9) if duration_ns > 0 else 0.0


def format_stats(final: dict) -> str:
    """The `--verbose` lines for the final (`done: true`) response object: Ollama's
    eight, plus the draft acceptance when speculative decoding ran."""
    prompt_count = int(final.get("prompt_eval_count") or 0)
    prompt_ns = int(final.get("prompt_eval_duration") or 0)
    eval_count = int(final.get("eval_count") or 0)
    eval_ns = int(final.get("eval_duration") or 0)
    rows = [
        ("total duration", format_duration(final.get("total_duration") or 0)),
        ("load duration", format_duration(final.get("load_duration") or 0)),
        ("prompt eval count", f"{prompt_count} token(s)"),
        ("prompt eval duration", format_duration(prompt_ns)),
        ("prompt eval rate", f"{_rate(prompt_count, prompt_ns):.2f} tokens/s"),
        ("eval count", f"{eval_count} token(s)"),
        ("eval duration", format_duration(eval_ns)),
        ("eval rate", f"{_rate(eval_count, eval_ns):.2f} tokens/s"),
    ]
    drafted = int(final.get("draft_count") or 0)
    if drafted:  # speculative decoding (a DRAFT in the Modelfile)
        kept = int(final.get("draft_accepted") or 0)
        rows.append(("draft acceptance", f"{kept}/{drafted} ({100 * kept / drafted:.0f}%)"))
    return "".join(f"{(label + ':').ljust(_STAT_LABEL_WIDTH)}{value}\n" for label, value in rows)


def terminal_width(stream: TextIO) -> int | None:
    """Columns of the terminal behind `stream`, or None when it is not a terminal."""
    try:
        if not stream.isatty():
            return None
    except (AttributeError, ValueError):
        return None
    return shutil.get_terminal_size((80, 24)).columns


class StreamWriter:
    """Writes streamed text deltas to a stream, flushing each, optionally word-wrapped.

    With a width, a word that would cross the right edge moves to the next line. A
    partial word is held back until whitespace (or `finish`) shows where it ends,
    so nothing already printed has to be erased.
    """

    def __init__(self, stream: TextIO, width: int | None = None):
        self._stream = stream
        # Ollama leaves a small right margin so the cursor never sits on the edge.
        self._width = max(width - 5, 10) if width else None
        self._column = 0
        self._word = ""
        self.text = ""  # everything written so far, unwrapped

    def write(self, delta: str) -> None:
        if not delta:
            return
        self.text += delta
        if self._width is None:
            self._emit(delta)
        else:
            for char in delta:
                if char.isspace():
                    self._flush_word()
                    self._emit_char(char)
                else:
                    self._word += char
        self._stream.flush()

    def finish(self) -> None:
        """Flush a held-back word and end the line if the text did not."""
        self._flush_word()
        if self.text and not self.text.endswith("\n"):
            self._emit("\n")
        self._stream.flush()

    def _flush_word(self) -> None:
        if not self._word:
            return
        if self._width is not None and self._column > 0 and self._column + len(self._word) > self._width:
            self._emit("\n")
        self._emit(self._word)
        self._word = ""

    def _emit_char(self, char: str) -> None:
        if char == " " and self._width is not None and self._column >= self._width:
            self._emit("\n")  # a space at the edge becomes the line break
            return
        self._emit(char)

    def _emit(self, text: str) -> None:
        self._stream.write(text)
        newline = text.rfind("\n")
        self._column = len(text) - newline - 1 if newline >= 0 else self._column + len(text)
