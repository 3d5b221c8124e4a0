"""`exl3 kernels`: build the compiled kernels now, ahead of first use, and say which run.

Each extension is otherwise built the first time it is needed (a minute or more for
the CUDA ones); building here suits a container image or a first run that should not
pause. Where one cannot be built the line says why and which fallback serves instead.
"""

from __future__ import annotations

import time
from pathlib import Path

import click

from exl3cli.ops.build import all_extensions, kernel_cache_root


@click.command("kernels")
def kernels() -> None:
    """Build the compiled kernels now (they are otherwise built on first use) and show
    which are in use. Cache: EXL3_KERNEL_CACHE (default ~/.cache/exl3/kernels);
    EXL3_NO_EXT=1 turns them all off."""
    click.echo(f"kernel cache: {kernel_cache_root()}")
    rows = []
    for extension in all_extensions():
        started = time.perf_counter()
        module = extension.get()
        seconds = time.perf_counter() - started
        if module is not None:
            where = Path(getattr(module, "__file__", "") or "?").parent.name
            rows.append((extension.label, "ready", f"{where} ({seconds:.1f} s)"))
        else:
            rows.append((extension.label, "unavailable", extension.reason or "unknown"))
    width = max(len(label) for label, _, _ in rows)
    for label, state, detail in rows:
        click.echo(f"{label:<{width}}  {state:<11}  {detail}")


COMMANDS = [kernels]
