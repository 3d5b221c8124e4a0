"""Recipes: bits per tensor chosen by name patterns (``exl3 convert --recipe FILE``).

A recipe is an ordered list of ``(pattern, bits)`` entries. A pattern is a shell-style
glob (``fnmatch``, case-sensitive) over module names such as
``model.layers.3.mlp.down_proj`` or ``lm_head``; later entries override earlier ones.
Bits are whole numbers 1..8 (trellis bits per weight) or 16 (kept unquantized, float16).

Files are YAML or JSON (chosen by the suffix; ``.yml``/``.yaml`` are YAML, anything else
JSON), either a mapping ``{pattern: bits, ...}`` (in file order) or, under the key
``bits``, such a mapping or a list of ``[pattern, bits]`` pairs. Other top-level keys
are kept as comments (``write_recipe`` adds ``format`` and ``note``)::

    "*": 4
    "*.mlp.down_proj": 5
    "model.layers.0.*": 6
    lm_head: 8

``write_recipe`` writes an allocation with every tensor named, so feeding it back
reproduces the conversion exactly.

Public API:
- ``RECIPE_BITS``: the allowed bit values.
- ``Recipe`` (a tuple of ``(pattern, bits)``); ``load_recipe(path) -> Recipe``;
  ``parse_recipe(data) -> Recipe``.
- ``resolve(recipe, names) -> dict[name, bits]``: the bits the recipe sets for each
  of ``names`` it matches (names it does not match are left out).
- ``unused_patterns(recipe, names) -> list[str]``: entries that match nothing.
- ``write_recipe(path, bits: dict[name, bits], note="")``.
"""

from __future__ import annotations

import json
import os
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any

from exl3cli.errors import ConversionError

RECIPE_BITS = (1, 2, 3, 4, 5, 6, 7, 8, 16)
RECIPE_FORMAT = "exl3-recipe/1"

Recipe = tuple[tuple[str, int], ...]


def _bits(pattern: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int | float) or value != int(value) \
            or int(value) not in RECIPE_BITS:
        raise ConversionError(f"recipe entry {pattern!r}: bits must be one of "
                              f"{', '.join(map(str, RECIPE_BITS))}, got {value!r}")
    return int(value)


def parse_recipe(data: Any) -> Recipe:
    """Validate recipe data (a mapping or a list of pairs, bare or under ``bits``)."""
    if isinstance(data, dict) and "bits" in data:
        data = data["bits"]
    elif isinstance(data, dict):
        data = {k: v for k, v in data.items() if k not in ("format", "note")}
    if isinstance(data, dict):
        pairs = list(data.items())
    elif isinstance(data, list):
        pairs = []
        for item in data:
            if not (isinstance(item, list | tuple) and len(item) == 2):
                raise ConversionError(f"recipe list entries must be [pattern, bits], got {item!r}")
            pairs.append((item[0], item[1]))
    else:
        raise ConversionError("a recipe is a mapping of name patterns to bits "
                              "(or a list of [pattern, bits] pairs)")
    recipe = []
    for pattern, value in pairs:
        if not isinstance(pattern, str) or not pattern:
            raise ConversionError(f"recipe patterns must be non-empty strings, got {pattern!r}")
        recipe.append((pattern, _bits(pattern, value)))
    if not recipe:
        raise ConversionError("the recipe has no entries")
    return tuple(recipe)


def load_recipe(path: str | Path) -> Recipe:
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConversionError(f"cannot read recipe {path}: {exc}") from exc
    try:
        if path.suffix.lower() in (".yml", ".yaml"):
            import yaml

            data = yaml.safe_load(text)
        else:
            data = json.loads(text)
    except Exception as exc:  # yaml.YAMLError, json.JSONDecodeError
        raise ConversionError(f"recipe {path} is not valid "
                              f"{'YAML' if path.suffix.lower() in ('.yml', '.yaml') else 'JSON'}: "
                              f"{str(exc).splitlines()[0]}") from exc
    return parse_recipe(data)


def resolve(recipe: Recipe, names: list[str]) -> dict[str, int]:
    chosen: dict[str, int] = {}
    for pattern, bits in recipe:
        for name in names:
            if fnmatchcase(name, pattern):
                chosen[name] = bits
    return chosen


def unused_patterns(recipe: Recipe, names: list[str]) -> list[str]:
    return [p for p, _ in recipe if not any(fnmatchcase(n, p) for n in names)]


def write_recipe(path: str | Path, bits: dict[str, int], note: str = "") -> None:
    """Every tensor's bits as a JSON recipe (atomically); ``note`` is kept as a comment."""
    path = Path(path)
    data = {"format": RECIPE_FORMAT, "note": note, "bits": dict(bits)}
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
    os.replace(tmp, path)
