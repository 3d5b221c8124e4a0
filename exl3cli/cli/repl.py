"""The interactive REPL of `exl3 run`: prompt_toolkit line editing around
`ReplProcessor` (repl_commands.py), streaming answers with Ctrl-C to stop one.

prompt_toolkit is imported only here and only when the REPL starts, so one-shot
runs work on machines without it.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any, TextIO

from exl3cli.cli.image_paths import encode_image_file, extract_image_paths
from exl3cli.cli.output import StreamWriter, format_stats, terminal_width
from exl3cli.cli.repl_commands import ReplOptions, ReplProcessor, ReplSession, ReplStep
from exl3cli.errors import Exl3Error

__all__ = ["ReplOptions", "run_repl", "history_path"]

_PLACEHOLDER = "Send a message (/? for help)"


def history_path() -> Path:
    """The REPL history file: `history` in the model store folder."""
    root = os.environ.get("EXL3_MODELS") or os.path.join("~", ".exl3", "models")
    return Path(root).expanduser() / "history"


def _toggleable_history(path: Path, session: ReplSession) -> Any:
    from prompt_toolkit.history import FileHistory

    class SessionFileHistory(FileHistory):
        """File history that stops recording while `/set nohistory` is on."""

        def append_string(self, string: str) -> None:
            if session.history:
                super().append_string(string)

    path.parent.mkdir(parents=True, exist_ok=True)
    return SessionFileHistory(str(path))


class Repl:
    """One interactive session; `pt_input`/`pt_output` let tests drive it."""

    def __init__(self, client: Any, options: ReplOptions, *, stdout: TextIO | None = None,
                 stderr: TextIO | None = None, pt_input: Any = None, pt_output: Any = None,
                 history_file: Path | None = None):
        self.client = client
        self.session = ReplSession.from_options(options)
        self.processor = ReplProcessor(self.session, client)
        self.stdout = stdout or sys.stdout
        self.stderr = stderr or sys.stderr
        self._pt_input = pt_input
        self._pt_output = pt_output
        self._history_file = history_file or history_path()

    def run(self) -> None:
        from prompt_toolkit import PromptSession
        from prompt_toolkit.formatted_text import FormattedText

        self._preload()
        prompt = PromptSession(history=_toggleable_history(self._history_file, self.session),
                               input=self._pt_input, output=self._pt_output)
        placeholder = FormattedText([("#888888", _PLACEHOLDER)])
        while True:
            continuing = self.processor.continuing
            try:
                line = prompt.prompt("... " if continuing else ">>> ",
                                     placeholder=None if continuing else placeholder)
            except KeyboardInterrupt:
                if not prompt.default_buffer.text and not self.processor.continuing:
                    self._print("\nUse Ctrl + d or /bye to exit.\n")
                self.processor.reset_input()
                continue
            except EOFError:
                self._print("\n")
                return
            step = self.processor.feed(line)
            if not self._apply(step):
                return

    def _apply(self, step: ReplStep) -> bool:
        """Carry out one step; False when the session ends."""
        if step.output:
            self._print(step.output)
        if step.exit:
            return False
        if step.preload:
            self._preload()
        if step.message is not None:
            self.answer(step.message)
        return True

    def _print(self, text: str) -> None:
        self.stdout.write(text)
        self.stdout.flush()

    def _preload(self) -> None:
        """Load the model before the first prompt, as `ollama run` does."""
        try:
            for _ in self.client.chat({"model": self.session.model, "messages": []}):
                pass
        except Exl3Error as error:
            self._print(f"Error: {error}\n")

    def answer(self, text: str) -> None:
        """Send a user message, stream the reply; Ctrl-C stops it but keeps the session."""
        session = self.session
        message: dict[str, Any] = {"role": "user", "content": text}
        text, paths = extract_image_paths(text)
        try:
            images = [encode_image_file(path) for path in [*session.pending_images, *paths]]
        except Exl3Error as error:
            self._print(f"Error: {error}\n\n")
            return
        if images:
            for path in paths:
                self._print(f"Added image '{path}'\n")
            message = {"role": "user", "content": text, "images": images}
        session.pending_images = []
        session.messages.append(message)
        width = terminal_width(self.stdout) if session.wordwrap else None
        writer = StreamWriter(self.stdout, width)
        thinking = _ThinkingDisplay(self.stdout, show=not session.hide_thinking)
        final: dict = {}
        chunks = None
        stopped = False
        try:
            chunks = self.client.chat(session.chat_request())
            for chunk in chunks:
                if chunk.get("done"):
                    final = chunk
                    break
                message = chunk.get("message") or {}
                thinking.write(message.get("thinking") or "")
                if message.get("content"):
                    thinking.end()
                    writer.write(message["content"])
        except KeyboardInterrupt:
            stopped = True  # stop this answer only; what was said so far stays in the chat
        except Exl3Error as error:
            session.messages.pop()
            writer.finish()
            self._print(f"Error: {error}\n\n")
            return
        finally:
            if chunks is not None and hasattr(chunks, "close"):
                chunks.close()
        thinking.end()
        writer.finish()
        self._print("\n")
        if writer.text:
            reply = {"role": "assistant", "content": writer.text}
            session.messages.append(reply)
            if stopped:
                session.interrupted.append(reply)  # not for /save
        else:
            session.messages.pop()  # nothing was answered: forget the question too
        if session.verbose and final:
            self.stderr.write(format_stats(final) + "\n")
            self.stderr.flush()


class _ThinkingDisplay:
    """Prints a thinking model's reasoning between `Thinking...` and `...done thinking.`"""

    def __init__(self, stream: TextIO, show: bool):
        self._stream = stream
        self._show = show
        self._open = False

    def write(self, text: str) -> None:
        if not text or not self._show:
            return
        if not self._open:
            self._stream.write("Thinking...\n")
            self._open = True
        self._stream.write(text)
        self._stream.flush()

    def end(self) -> None:
        if self._open:
            self._stream.write("\n...done thinking.\n\n")
            self._stream.flush()
            self._open = False


def run_repl(client: Any, options: ReplOptions) -> None:
    """Start the interactive REPL on the process's terminal."""
    Repl(client, options).run()
