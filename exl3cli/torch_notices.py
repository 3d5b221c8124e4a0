"""Keep torch's build-environment notices out of what users read.

A CUDA build of torch on a machine without a GPU logs "No CUDA runtime is found, using
CUDA_HOME=..." the first time `torch.utils.cpp_extension` is imported (that is, the first
time exl3 looks for its kernels). The notice says nothing a user can act on: exl3 already
says, once, when it falls back to the pure-PyTorch path (`exl3 kernels` says why). Left
alone it lands in `--verbose` stderr, between an answer and its stats, and in the output of
every command run under click's test runner.
"""

from __future__ import annotations

import logging

CPP_EXTENSION_LOGGER = "torch.utils.cpp_extension"
NOTICES = ("No CUDA runtime is found",)


class DropTorchNotices(logging.Filter):
    """Drops the records whose message starts with one of `NOTICES`; keeps the rest."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(NOTICES)


def silence_torch_notices() -> None:
    """Attach the filter to torch's cpp_extension logger (once; safe to call again).

    The logger is looked up by name, so this works before torch is even imported.
    """
    logger = logging.getLogger(CPP_EXTENSION_LOGGER)
    if not any(isinstance(f, DropTorchNotices) for f in logger.filters):
        logger.addFilter(DropTorchNotices())
