"""Plugin hook specifications and the plugin manager.

Built-in plugins (the `exl3_plugins` package) register through the same
`exl3cli` entry-point group that third-party packages use, so the core never
imports them directly.
"""

from __future__ import annotations

import functools
from typing import Any

import pluggy

PROJECT = "exl3cli"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


class Exl3HookSpecs:
    @hookspec
    def exl3_architectures(self) -> dict[str, Any]:
        """Return {Hugging Face `architectures` string: ArchitectureSpec}.

        An ArchitectureSpec (exl3cli.engine.spec.architecture) maps config.json keys and
        tensor names onto the engine's shared building blocks.
        """

    @hookspec
    def exl3_samplers(self) -> list[Any]:
        """Return SamplerStep objects (exl3cli.engine.generation.sampling).

        Each step has a name, typed parameters with defaults and a position in the
        pipeline; the engine assembles the pipeline from request options.
        """

    @hookspec
    def exl3_drafters(self) -> dict[str, Any]:
        """Return {name: drafter factory} for speculative decoding (`DRAFT`)."""

    @hookspec
    def exl3_model_sources(self) -> list[Any]:
        """Return ModelSource objects (exl3cli.store.sources) that `pull` can fetch from."""


def _new_plugin_manager() -> pluggy.PluginManager:
    manager = pluggy.PluginManager(PROJECT)
    manager.add_hookspecs(Exl3HookSpecs)
    manager.load_setuptools_entrypoints(PROJECT)
    return manager


@functools.lru_cache(maxsize=1)
def get_plugin_manager() -> pluggy.PluginManager:
    """The process-wide plugin manager with every installed plugin loaded."""
    return _new_plugin_manager()


def reset_plugin_manager() -> None:
    """Forget the cached manager (tests that install a plugin at run time call this)."""
    get_plugin_manager.cache_clear()
