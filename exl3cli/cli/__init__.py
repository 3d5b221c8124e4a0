"""The `exl3` command: a click group whose subcommands live one family per module."""

from __future__ import annotations

import sys

import click

from exl3cli import __version__
from exl3cli.errors import Exl3Error


class Exl3Group(click.Group):
    """Translates library errors into one line on stderr and exit status 1."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except Exl3Error as error:
            click.echo(f"Error: {error}", err=True)
            sys.exit(1)
        except KeyboardInterrupt:
            click.echo("", err=True)
            sys.exit(130)
        except BrokenPipeError:
            sys.exit(1)


@click.group(cls=Exl3Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, "--version", "-v", prog_name="exl3",
                      message="exl3 version %(version)s")
@click.option("--verbose", "verbose", is_flag=True, default=False, hidden=True)
def main(verbose: bool) -> None:
    """exl3: chat with, serve and quantize EXL3 language models."""


def _register_commands() -> None:
    from exl3cli.cli import bench, convert, kernels, models, pull, run, serve

    for module in (models, pull, run, serve, convert, bench, kernels):
        for command in module.COMMANDS:
            main.add_command(command)


_register_commands()
