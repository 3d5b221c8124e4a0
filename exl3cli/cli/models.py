"""Store commands: `list`/`ls`, `show`, `cp`, `rm`, `create`.

Each command parses its arguments, asks the one client (`get_client()`), and prints;
library errors travel up to the group, which prints them as one line and exits 1.
"""

from __future__ import annotations

import os
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import click

from exl3cli.client import get_client
from exl3cli.errors import Exl3Error

_SHOW_FIELDS = ("modelfile", "parameters", "system", "template", "license")


def human_size(size: int) -> str:
    """Bytes in decimal units the way Ollama prints them: `270 MB`, `4.7 GB`."""
    value = float(size)
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if value < 1000 or unit == "TB":
            break
        value /= 1000
    if unit == "B":
        return f"{int(value)} B"
    return f"{value:.1f} {unit}" if value < 10 else f"{int(value)} {unit}"


def human_ago(when: datetime, now: datetime | None = None) -> str:
    """`2 hours ago`, `About a minute ago`, `Less than a second ago`."""
    now = now or datetime.now(timezone.utc)
    seconds = max((now - when).total_seconds(), 0.0)
    if seconds < 1:
        return "Less than a second ago"
    # (below this many seconds, count in this unit, what to say for exactly one)
    for limit, unit, name, one in ((60, 1, "second", "1 second ago"),
                                   (3600, 60, "minute", "About a minute ago"),
                                   (86400, 3600, "hour", "About an hour ago"),
                                   (7 * 86400, 86400, "day", "1 day ago"),
                                   (30 * 86400, 7 * 86400, "week", "1 week ago"),
                                   (365 * 86400, 30 * 86400, "month", "1 month ago"),
                                   (float("inf"), 365 * 86400, "year", "1 year ago")):
        if seconds < limit:
            count = int(seconds // unit)
            return one if count == 1 else f"{count} {name}s ago"
    raise AssertionError("unreachable")


def format_table(header: list[str], rows: list[list[str]]) -> str:
    """Borderless, left-aligned columns separated by at least four spaces."""
    widths = [max(len(str(row[i])) for row in [header, *rows]) for i in range(len(header))]
    lines = []
    for row in [header, *rows]:
        cells = [str(cell).ljust(width + 4) for cell, width in zip(row[:-1], widths[:-1], strict=True)]
        lines.append(("".join(cells) + str(row[-1])).rstrip())
    return "\n".join(lines)


@click.command("list")
def list_models() -> None:
    """List models in the store."""
    rows = []
    for model in get_client().list()["models"]:
        modified = datetime.fromisoformat(model["modified_at"].replace("Z", "+00:00"))
        rows.append([model["name"], model["digest"][:12], human_size(model["size"]),
                     human_ago(modified)])
    click.echo(format_table(["NAME", "ID", "SIZE", "MODIFIED"], rows))


# `ls` is the same command under a second name, as in Ollama.
ls_models = click.Command("ls", callback=list_models.callback, params=list_models.params,
                          help="List models in the store (same as list).")


def _indented(text: str) -> str:
    return "\n".join(f"    {line}" for line in text.strip("\n").splitlines())


def _summary(info: dict[str, Any]) -> str:
    """The `show` overview: Model, Adapter, Parameters, System, License sections."""
    details, model_info = info.get("details") or {}, info.get("model_info") or {}
    arch = model_info.get("general.architecture", details.get("family", ""))
    rows = [["architecture", arch], ["parameters", details.get("parameter_size", "")]]
    for label, key in (("context length", "context_length"),
                       ("embedding length", "embedding_length")):
        if f"{arch}.{key}" in model_info:
            rows.append([label, str(model_info[f"{arch}.{key}"])])
    rows.append(["quantization", details.get("quantization_level", "")])
    sections = [f"  Model\n{_indented(format_table(*_split(rows)))}"]
    if info.get("adapter"):  # a LoRA adapter (Modelfile ADAPTER)
        sections.append(f"  Adapter\n{_indented(info['adapter'])}")
    if info.get("parameters"):
        sections.append(f"  Parameters\n{_indented(info['parameters'])}")
    if info.get("system"):
        sections.append(f"  System\n{_indented(info['system'])}")
    if info.get("license"):
        license_lines = info["license"].strip("\n").splitlines()
        shown = "\n".join(license_lines[:2]) + ("\n..." if len(license_lines) > 2 else "")
        sections.append(f"  License\n{_indented(shown)}")
    return "\n\n".join(sections) + "\n"


def _split(rows: list[list[str]]) -> tuple[list[str], list[list[str]]]:
    return rows[0], rows[1:]


@click.command("show")
@click.argument("model")
@click.option("--modelfile", "field", flag_value="modelfile", help="Show the Modelfile.")
@click.option("--parameters", "field", flag_value="parameters", help="Show parameters.")
@click.option("--system", "field", flag_value="system", help="Show the system message.")
@click.option("--template", "field", flag_value="template", help="Show the template.")
@click.option("--license", "field", flag_value="license", help="Show the license.")
def show(model: str, field: str | None) -> None:
    """Show information about a model."""
    info = get_client().show({"model": model})
    if field is None:
        click.echo(_summary(info), nl=False)
    elif field == "modelfile":
        click.echo('# Modelfile generated by "exl3 show"')
        click.echo(info["modelfile"], nl=False)
    else:
        text = info.get(field) or ""
        click.echo(text, nl=not text.endswith("\n"))


@click.command("cp")
@click.argument("source")
@click.argument("destination")
def copy(source: str, destination: str) -> None:
    """Copy a model (the new name shares the old one's files)."""
    get_client().copy({"source": source, "destination": destination})
    click.echo(f"copied '{source}' to '{destination}'")


@click.command("rm")
@click.argument("models", nargs=-1, required=True)
def remove(models: tuple[str, ...]) -> None:
    """Remove one or more models."""
    client = get_client()
    for model in models:  # check every name first: all are removed or none
        client.show({"model": model})
    for model in models:
        client.delete({"model": model})
        click.echo(f"deleted '{model}'")


@click.command("create")
@click.argument("name")
@click.option("-f", "--file", "modelfile", default="Modelfile", show_default=True,
              help="Path to the Modelfile.")
def create(name: str, modelfile: str) -> None:
    """Create a model from a Modelfile (weights are shared, never copied).

    
    ADAPTER applies a LoRA adapter: a PEFT folder (adapter_config.json +
    adapter_model.safetensors) or a stored model made with one. Models that differ
    only in ADAPTER share one loaded base model, and their requests one batch."""
    path = Path(modelfile).expanduser()
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise Exl3Error(f"no Modelfile at '{modelfile}'") from None
    except (OSError, UnicodeDecodeError) as error:
        raise Exl3Error(f"cannot read Modelfile '{modelfile}': {error}") from None
    request = {"model": name, "modelfile": text, "base_dir": os.path.abspath(path.parent)}
    last = None
    for event in get_client().create(request):
        status = event.get("status")
        if status and status != last:
            click.echo(status, err=True)
            last = status


COMMANDS = [list_models, ls_models, show, copy, remove, create]
