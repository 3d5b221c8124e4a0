"""`exl3 run`: one-shot answers, pipes, and the interactive REPL.

The command only talks to the client interface (`exl3cli.client.get_client()`), so
the same code drives the in-process engine and, later, a daemon.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import Any, TextIO

import click

from exl3cli.cli.image_paths import encode_image_file, extract_image_paths
from exl3cli.cli.output import StreamWriter, format_stats, terminal_width
from exl3cli.cli.progress import show_progress
from exl3cli.errors import Exl3Error, ModelNotFound


def ensure_model(client: Any, model: str, progress: TextIO) -> dict:
    """`show` the model, pulling it first when the store lacks it (like `ollama run`)."""
    try:
        return client.show({"model": model})
    except ModelNotFound:
        pass
    show_progress(client.pull({"model": model}), progress)
    return client.show({"model": model})


def stream_answer(chunks: Iterator[dict], writer: StreamWriter) -> dict:
    """Write each streamed text delta; return the final (`done: true`) object."""
    final: dict = {}
    try:
        for chunk in chunks:
            if "error" in chunk:
                raise Exl3Error(str(chunk["error"]))
            if chunk.get("done"):
                final = chunk
                break
            text = chunk["message"].get("content", "") if "message" in chunk \
                else chunk.get("response", "")
            writer.write(text)
    finally:
        close = getattr(chunks, "close", None)
        if close is not None:
            close()  # stops the engine when we leave early (Ctrl-C, broken pipe)
    return final


def build_one_shot_prompt(stdin_text: str | None, prompt_args: tuple[str, ...]) -> str:
    """Piped input first, then the prompt arguments, separated by a blank line."""
    parts = []
    if stdin_text and stdin_text.strip():
        parts.append(stdin_text.rstrip("\n"))
    if prompt_args:
        parts.append(" ".join(prompt_args))
    return "\n\n".join(parts)


def run_one_shot(client: Any, model: str, prompt: str, *, system: str | None,
                 format_: str | None, keepalive: str | None, think: bool | None,
                 hide_thinking: bool, verbose: bool, wordwrap: bool,
                 images: tuple[str, ...] = ()) -> None:
    req: dict[str, Any] = {"model": model, "prompt": prompt, "stream": True}
    prompt, paths = extract_image_paths(prompt)  # image files named in the prompt too
    if paths:
        req["prompt"] = prompt
    if images or paths:
        req["images"] = [encode_image_file(path) for path in [*images, *paths]]
    if system:
        req["system"] = system
    if format_:
        req["format"] = format_
    if keepalive is not None:
        req["keep_alive"] = keepalive
    if think is not None:
        req["think"] = think
    out = sys.stdout
    writer = StreamWriter(out, terminal_width(out) if wordwrap else None)
    chunks = client.generate(req)
    if not prompt and not req.get("images"):
        stream_answer(chunks, writer)  # an empty prompt only loads the model
        return
    thinking_shown = think and not hide_thinking
    final = stream_answer(_with_thinking(chunks, thinking_shown, sys.stderr), writer)
    writer.finish()
    if verbose and final:
        sys.stderr.write("\n" + format_stats(final))
        sys.stderr.flush()


def _with_thinking(chunks: Iterator[dict], show: bool, stream: TextIO) -> Iterator[dict]:
    """Pass chunks through, printing their `thinking` deltas to `stream` when asked
    (stderr in one-shot mode, so the answer alone goes down a pipe)."""
    try:
        for chunk in chunks:
            thinking = chunk.get("thinking") or (chunk.get("message") or {}).get("thinking")
            if thinking and show and not chunk.get("done"):
                stream.write(thinking)
                stream.flush()
            yield chunk
    finally:
        close = getattr(chunks, "close", None)
        if close is not None:
            close()


@click.command("run")
@click.argument("model")
@click.argument("prompt", nargs=-1)
@click.option("--format", "format_", metavar="FORMAT",
              help='Response format (e.g. "json").')
@click.option("--keepalive", metavar="DURATION",
              help="How long the model stays loaded (e.g. 5m).")
@click.option("--verbose", is_flag=True, help="Show timings for the response.")
@click.option("--nowordwrap", is_flag=True,
              help="Don't wrap words to the next line automatically.")
@click.option("--think", is_flag=True, default=None,
              help="Let thinking models think before answering.")
@click.option("--hidethinking", is_flag=True,
              help="Hide the thinking output (thinking models).")
@click.option("--system", metavar="TEXT", help="System message for this run.")
@click.option("--image", "images", multiple=True, metavar="FILE",
              type=click.Path(exists=True, dir_okay=False),
              help="An image (PNG, JPEG, WebP) for an image-text model to look at; "
                   "repeat for several. In the REPL, image paths in a message work too.")
def run(model: str, prompt: tuple[str, ...], format_: str | None, keepalive: str | None,
        verbose: bool, nowordwrap: bool, think: bool | None, hidethinking: bool,
        system: str | None, images: tuple[str, ...]) -> None:
    """Run a model: answer PROMPT, or chat interactively when none is given."""
    from exl3cli.client import get_client

    if format_ not in (None, "", "json"):
        raise click.BadParameter("only 'json' is supported", param_hint="--format")
    if hidethinking and think is None:
        think = True
    client = get_client()
    ensure_model(client, model, sys.stderr)

    stdin_tty = sys.stdin.isatty()
    interactive = stdin_tty and sys.stdout.isatty() and not prompt
    if interactive:
        from exl3cli.cli.repl import ReplOptions, run_repl

        run_repl(client, ReplOptions(model=model, system=system, format=format_ or None,
                                     keepalive=keepalive, verbose=verbose,
                                     wordwrap=not nowordwrap, think=think,
                                     hide_thinking=hidethinking, images=images))
        return
    stdin_text = None if stdin_tty else sys.stdin.read()
    text = build_one_shot_prompt(stdin_text, prompt)
    run_one_shot(client, model, text, system=system, format_=format_, keepalive=keepalive,
                 think=think, hide_thinking=hidethinking, verbose=verbose,
                 wordwrap=not nowordwrap and stdin_tty, images=images)


COMMANDS = [run]
