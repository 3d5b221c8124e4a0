"""`exl3 pull MODEL`: fetch a model into the store, with progress on stderr."""

from __future__ import annotations

import click

from exl3cli.cli.progress import ProgressPrinter, show_progress

PullProgress = ProgressPrinter  # the name this module gave it first


@click.command("pull")
@click.argument("model")
def pull(model: str) -> None:
    """Pull a model from its sources (catalog name or hf.co/<user>/<repo>[:<revision>]).

    A model already in the store (all its files present) is not fetched again; `exl3 rm`
    it first to fetch it anew. Progress bars on a terminal, plain lines otherwise."""
    from exl3cli.client import get_client

    show_progress(get_client().pull({"model": model}))


COMMANDS = [pull]
