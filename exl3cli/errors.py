"""Exceptions raised by library code.

The CLI and the HTTP layer translate these once, in one place, into a one-line
message (CLI) or a JSON error with a status code (HTTP). `http_status` says which.
"""

from __future__ import annotations


class Exl3Error(Exception):
    """Base of every error a user can cause; its message is shown as is."""

    http_status = 400


class InvalidModelName(Exl3Error):
    """A model name that is malformed or would escape the store."""


class ModelNotFound(Exl3Error):
    """A name that the store (or any pull source) does not know."""

    http_status = 404


class ModelfileError(Exl3Error):
    """A Modelfile that does not parse; carries the 1-based line number."""

    def __init__(self, line: int, message: str):
        self.line = line
        self.detail = message
        super().__init__(f"Modelfile line {line}: {message}")


class PullError(Exl3Error):
    """A model source failed to provide a model."""

    http_status = 502


class ModelLoadError(Exl3Error):
    """A model folder that cannot be loaded (missing files, unsupported architecture)."""

    http_status = 500


class UnsupportedArchitecture(ModelLoadError):
    """config.json names an architecture no plugin provides."""


class InvalidOption(Exl3Error):
    """A generation option with a wrong type or value."""


class InvalidSetting(Exl3Error, ValueError):
    """An EXL3_* environment variable with a value exl3 does not know (also a
    ValueError, what these checks raised before they had a class)."""


class ContextOverflow(Exl3Error):
    """A prompt that does not fit into the model's context window."""


class ChatTemplateError(Exl3Error):
    """A chat template that does not compile, or that rejects the given messages."""


class ServerBusy(Exl3Error):
    """The daemon's queue for a model is full; retry later."""

    http_status = 503


class GeneratorBusy(Exl3Error):
    """The generator's job queue is full; try again later."""

    http_status = 503


class ConversionError(Exl3Error):
    """A model conversion that cannot proceed (bad calibration text, mismatched --resume)."""


class AdapterError(Exl3Error):
    """A LoRA adapter that cannot be read or does not fit the model it is put on; the
    message names the adapter and the mismatch."""


class RankFailure(Exl3Error):
    """A tensor-parallel rank died or stopped answering: the model it served is stopped
    (the daemon stays up and loads it again on the next request)."""

    http_status = 500
