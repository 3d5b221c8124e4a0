"""What a generate/chat request's settings mean: keep_alive durations, option merging
(manifest PARAMETERs < request options), typed option reads, and the runner's
concurrency and KV cache settings."""

from __future__ import annotations

import logging
import os
import re
from datetime import datetime, timezone
from typing import Any

from exl3cli.errors import InvalidOption

log = logging.getLogger(__name__)

DEFAULT_KEEP_ALIVE = "5m"
DEFAULT_NUM_PARALLEL = 4


def now_iso() -> str:
    """`created_at` as Ollama writes it: UTC, microseconds, trailing Z."""
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def parse_keep_alive(value: Any) -> float | None:
    """Seconds a model stays loaded after a request; None means forever.

    Accepts what Ollama accepts: a number of seconds, or a duration string such as
    `5m`, `1h30m`, `300ms`, `0`, `-1`.
    """
    if value is None or value == "":
        value = os.environ.get("EXL3_KEEP_ALIVE", DEFAULT_KEEP_ALIVE)
    if isinstance(value, bool):
        raise InvalidOption(f"invalid keep_alive: {value!r}")
    if isinstance(value, (int, float)):
        seconds = float(value)
    else:
        text = str(value).strip()
        try:
            seconds = float(text)
        except ValueError:
            seconds = _parse_duration_text(text)
    if seconds != seconds:
        raise InvalidOption(f"invalid keep_alive: {value!r}")
    if seconds < 0:
        return None
    if seconds > MAX_KEEP_ALIVE_SECONDS:
        raise InvalidOption(f"keep_alive {value!r} is too long (at most 100 years; "
                            "a negative value keeps the model loaded forever)")
    return seconds


_DURATION_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0,
                   "h": 3600.0}
_DURATION_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|ms|s|m|h)")


def _parse_duration_text(text: str) -> float:
    sign = -1.0 if text.startswith("-") else 1.0
    body = text.lstrip("+-")
    parts = _DURATION_PART.findall(body)
    if not parts or "".join(number + unit for number, unit in parts) != body:
        raise InvalidOption(f"invalid duration: {text!r} (use e.g. 30s, 5m, 1h, 0, -1)")
    return sign * sum(float(number) * _DURATION_UNITS[unit] for number, unit in parts)


# Values a sampler or limit can mean, inclusive; None leaves that side open. A value
# outside is refused (400) rather than producing an empty or garbled answer.
OPTION_RANGES: dict[str, tuple[float | None, float | None]] = {
    "num_ctx": (1, None), "num_predict": (-2, None), "num_keep": (-1, None),
    "temperature": (0, None), "top_k": (0, None), "top_p": (0, 1), "min_p": (0, 1),
    "typical_p": (0, 1), "repeat_penalty": (0, None), "repeat_last_n": (-1, None),
    "dry_multiplier": (0, None), "dry_base": (0, None), "dry_allowed_length": (0, None),
    "xtc_probability": (0, 1), "xtc_threshold": (0, 1), "draft_num_predict": (0, None),
    "num_gpu": (-1, None), "tensor_parallel": (1, None),
}
# Past this keep_alive (about 100 years) a duration means nothing; -1 says "forever".
MAX_KEEP_ALIVE_SECONDS = 100 * 365 * 24 * 3600.0


def check_option_value(name: str, value: Any, where: str = "") -> None:
    """InvalidOption when a known numeric option lies outside what it can mean."""
    low, high = OPTION_RANGES.get(name, (None, None))
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return
    if value != value:  # NaN
        raise InvalidOption(f"option {where}{name} must be a number")
    if (low is not None and value < low) or (high is not None and value > high):
        if high is None:
            wanted = f"at least {low:g}"
        elif low is None:
            wanted = f"at most {high:g}"
        else:
            wanted = f"between {low:g} and {high:g}"
        raise InvalidOption(f"option {where}{name} must be {wanted}, got {value!r}")


def known_option_names() -> set[str]:
    """Every option a request may set: the Modelfile PARAMETER names."""
    from exl3cli.store.modelfile import PARAMETER_TYPES

    return set(PARAMETER_TYPES)


# Options other servers know that exl3 does not implement: refused when they would
# change the answer (a nonzero mirostat), so nobody believes they took effect.
UNSUPPORTED_OPTIONS = {
    "mirostat": "mirostat sampling is not supported (leave mirostat at 0; temperature, "
                "top_p, min_p, dry_* and xtc_* are)",
}
def refuse_unsupported(req: dict[str, Any]) -> None:
    """InvalidOption for request fields that would otherwise be accepted and ignored:
    a nonzero mirostat, a per-request num_gpu (layers are placed when the model loads,
    from the Modelfile's PARAMETER num_gpu). (Images are refused by the runner for
    text-only models: runtime/images.py.)"""
    options = req.get("options")
    if isinstance(options, dict):
        for name, message in UNSUPPORTED_OPTIONS.items():
            if options.get(name) not in (None, 0, 0.0, False, "0"):
                raise InvalidOption(f"option {name}: {message}")
        for name in ("num_gpu", "tensor_parallel", "gpu_split"):
            if options.get(name) is not None:
                raise InvalidOption(f"option {name}: layers are placed when a model loads; "
                                    f"set PARAMETER {name} in its Modelfile (a per-request "
                                    f"{name} is not supported)")


def merge_options(parameters: dict[str, Any] | None,
                  options: dict[str, Any] | None) -> tuple[dict[str, Any], list[str]]:
    """Manifest PARAMETERs overlaid by request options; returns (merged, ignored names).

    Unknown request options are dropped with a warning, as Ollama does, so a client
    written for another server keeps working.
    """
    merged = dict(parameters or {})
    ignored: list[str] = []
    known = known_option_names()
    for name, value in (options or {}).items():
        if name not in known:
            ignored.append(name)
            continue
        if value is None:
            continue
        check_option_value(name, value)
        merged[name] = value
    if isinstance(merged.get("stop"), str):
        merged["stop"] = [merged["stop"]]
    for name in ignored:
        log.warning("invalid option provided: %s (ignored)", name)
    return merged, ignored


def int_option(options: dict[str, Any], name: str) -> int | None:
    value = options.get(name)
    if value is None:
        return None
    try:
        return int(value)
    except (TypeError, ValueError):
        raise InvalidOption(f"option {name} must be an integer, got {value!r}") from None


def default_num_parallel() -> int:
    """Requests one loaded model serves at once: $EXL3_NUM_PARALLEL, else 4."""
    text = os.environ.get("EXL3_NUM_PARALLEL", "").strip()
    try:
        return max(1, int(text)) if text else DEFAULT_NUM_PARALLEL
    except ValueError:
        raise InvalidOption(f"EXL3_NUM_PARALLEL must be an integer, got {text!r}") from None


def cache_type_option(options: dict[str, Any]) -> Any:
    """The KV cache type a request asks for (`kv_cache_type`), else the environment's."""
    from exl3cli.engine.kvcache.kv_quant import resolve_kv_cache_type

    value = options.get("kv_cache_type")
    if value is not None and not isinstance(value, str):
        raise InvalidOption(f"option kv_cache_type must be a string, got {value!r}")
    return resolve_kv_cache_type(value)


def drafter_for(draft: str | None, options: dict[str, Any],
                vocab_size: int | None = None, store: Any = None) -> tuple[Any, int]:
    """(Drafter, tokens per step) for a manifest's DRAFT and the request's
    `draft_num_predict`; (None, 0) without a DRAFT or with `draft_num_predict` 0. A
    draft model that cannot serve (missing, or another vocabulary than the model's
    `vocab_size`) is refused with InvalidOption naming it (`create` checks the same, so
    this happens only when the draft went away later); `draft_num_predict 0` decodes
    without it. A draft model's name is looked up in `store` (the caller's), a folder
    path is used as it is."""
    if not draft:
        return None, 0
    from exl3cli.engine.generation.speculative import draft_count, make_drafter, resolve_draft
    from exl3cli.errors import Exl3Error

    count = draft_count(options)
    if count == 0:
        return None, 0
    try:
        drafter = make_drafter(draft if store is None else resolve_draft(draft, store.model_folder))
        theirs = getattr(drafter, "vocab_size", None)
        if vocab_size is not None and theirs is not None and theirs != vocab_size:
            raise InvalidOption(f"its vocabulary has {theirs} tokens, the model's {vocab_size}")
    except Exl3Error as error:
        raise InvalidOption(f"DRAFT {draft} cannot be used ({error}); pull or recreate it, "
                            "or set draft_num_predict 0 to decode without it") from None
    return drafter, count
