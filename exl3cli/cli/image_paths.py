"""Images named on the command line or in a REPL message (as `ollama run` reads them):
paths of existing .png/.jpg/.jpeg/.webp files, plain, quoted or with escaped spaces,
are taken out of the text and sent as base64 images."""

from __future__ import annotations

import base64
import re
from pathlib import Path

from exl3cli.errors import InvalidOption

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp")
_WORD = re.compile(r"'([^']+)'|\"([^\"]+)\"|((?:[^\s\\]|\\.)+)")


def encode_image_file(path: str | Path) -> str:
    """A file's bytes as base64 text; InvalidOption when it cannot be read."""
    try:
        return base64.b64encode(Path(path).expanduser().read_bytes()).decode("ascii")
    except OSError as error:
        raise InvalidOption(f"cannot read image {path}: {error.strerror or error}") from None


def extract_image_paths(text: str) -> tuple[str, list[Path]]:
    """(text without the image paths it names, those paths in order). Only paths of
    existing files with an image suffix count; anything else stays text."""
    found: list[Path] = []
    kept: list[str] = []
    last = 0
    for match in _WORD.finditer(text):
        raw = next(group for group in match.groups() if group is not None)
        candidate = Path(re.sub(r"\\(.)", r"\1", raw) if match.group(3) else raw).expanduser()
        if candidate.suffix.lower() in IMAGE_SUFFIXES and candidate.is_file():
            found.append(candidate)
            kept.append(text[last:match.start()])
            last = match.end()
    if not found:
        return text, []
    kept.append(text[last:])
    return re.sub(r"[ \t]{2,}", " ", "".join(kept)).strip(), found
