"""What `create` checks before it stores a model, so a Modelfile that could never run
is refused at create, naming its line, instead of failing at every later run.

- an ADAPTER (or uploaded adapter) is a PEFT LoRA that fits the model (runtime/adapters.py);
- the FROM model's architecture is one a plugin supports;
- a TEMPLATE is a Jinja2 chat template (Ollama's Go templates are recognised and
  refused with a pointer to what to write instead);
- a DRAFT names a drafter (`ngram`), a model in the store or a model folder, with the
  model's vocabulary.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

from exl3cli.errors import ChatTemplateError, Exl3Error, ModelfileError
from exl3cli.runtime.adapters import adapter_files, check_adapter
from exl3cli.store.manifest import Manifest
from exl3cli.store.modelfile import Modelfile
from exl3cli.store.store import ModelStore

# `{{ .Prompt }}`, `{{- if .System }}`, `{{ range .Messages }}`, `{{ end }}`, `$.Tools`:
# the marks of Go's text/template, which Ollama's TEMPLATE uses.
_GO_TEMPLATE = re.compile(r"\{\{-?\s*(?:(?:if|range|with|else if)\s+)?[.$]|\{\{-?\s*end\s*-?\}\}")


def check_new_model(store: ModelStore, manifest: Manifest, modelfile: Modelfile) -> None:
    """ModelfileError for the first thing in `manifest` (built from `modelfile`) that
    cannot work."""
    config = _manifest_config(store, manifest)
    check_architecture(config, modelfile.from_line, modelfile.from_)
    if adapter_files(manifest):
        check_adapter(store, manifest, modelfile.lines.get("adapter", 0))
    if modelfile.template is not None:
        check_template(modelfile.template, modelfile.lines.get("template", 0))
    if modelfile.draft is not None and manifest.draft:
        check_draft(store, manifest.draft, config, modelfile.lines.get("draft", 0))


def check_architecture(config: dict[str, Any] | None, line: int, source: str) -> None:
    from exl3cli.engine.spec.architecture import get_architecture

    names = (config or {}).get("architectures") or []
    if not names:
        return  # nothing to check against (the loader says more at run)
    try:
        get_architecture(str(names[0]))
    except Exl3Error as error:
        raise ModelfileError(line, f"FROM {source}: {error}") from None


def looks_like_go_template(text: str) -> bool:
    return bool(_GO_TEMPLATE.search(text))


def check_template(text: str, line: int) -> None:
    from exl3cli.engine.text.chat_template import ChatTemplate

    if looks_like_go_template(text):
        raise ModelfileError(line, "TEMPLATE is an Ollama (Go) template; exl3 reads Jinja2 "
                                   "chat templates like the chat_template of "
                                   "tokenizer_config.json (e.g. {% for m in messages %}"
                                   "{{ m['content'] }}{% endfor %}), or leave TEMPLATE out to "
                                   "use the model's own")
    try:
        ChatTemplate(text)
    except ChatTemplateError as error:
        raise ModelfileError(line, f"TEMPLATE: {error}") from None


def check_draft(store: ModelStore, draft: str, config: dict[str, Any] | None,
                line: int) -> None:
    from exl3cli.engine.generation.speculative import is_drafter_name

    if is_drafter_name(draft):
        return
    folder = Path(os.path.expanduser(draft.strip()))
    if folder.is_dir():
        if not (folder / "config.json").is_file():
            raise ModelfileError(line, f"DRAFT {draft}: not a model folder (no config.json)")
        theirs = json.loads((folder / "config.json").read_text())
    elif folder.is_absolute():
        raise ModelfileError(line, f"DRAFT {draft}: no such folder")
    else:
        try:
            exists = store.exists(draft)
        except Exl3Error as error:
            raise ModelfileError(line, f"DRAFT {draft}: {error}") from None
        if not exists:
            raise ModelfileError(line, f"DRAFT {draft}: not a drafter (ngram) and not a model "
                                       "in the store (pull it first)")
        theirs = _manifest_config(store, store.read_manifest(draft))
    ours_vocab = (config or {}).get("vocab_size")
    theirs_vocab = (theirs or {}).get("vocab_size")
    if ours_vocab and theirs_vocab and ours_vocab != theirs_vocab:
        raise ModelfileError(line, f"DRAFT {draft}: its vocabulary has {theirs_vocab} tokens, "
                                   f"the model's {ours_vocab} (a draft must share the "
                                   "model's tokenizer)")


def _manifest_config(store: ModelStore, manifest: Manifest) -> dict[str, Any] | None:
    """The model's config.json (its text_config for multimodal wrappers' vocab)."""
    digest = manifest.files.get("config.json")
    if not digest:
        return None
    try:
        config = json.loads(store.blob_path(digest).read_text())
    except (OSError, ValueError):
        return None
    text = config.get("text_config")
    if isinstance(text, dict) and "vocab_size" not in config and "vocab_size" in text:
        config = {**config, "vocab_size": text["vocab_size"]}
    return config
