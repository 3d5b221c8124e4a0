"""The generator's side of the batch-invariant mode (ops/batch_invariant.py has the
kernels' side): every step, prompt chunks included, runs on the fixed-shape decode step,
one row per token, so a prompt token goes through the same arithmetic as a decoded one
and a job's logits do not depend on which jobs share its steps, how its prompt was cut
into chunks or whether its prefix came from the cache.

A prompt chunk rides beside the step's decode rows (and drafts) in the rows left of
``DecodeRunner.max_rows``; its last row gives the logits. A step the fixed-shape step
cannot take (a prompt with image spans, which it does not embed; a model without it)
falls back to the general path, which is not invariant. A generator in the mode runs at
most 64 jobs at once (``max_jobs``).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch

from exl3cli.engine.generation.draft_policy import fit_rows
from exl3cli.ops.batch_invariant import batch_invariant, set_batch_invariant
from exl3cli.ops.cuda_kernels import FUSED_MAX_ROWS


def resolve(flag: bool | None) -> bool:
    """The mode of a new generator: `flag`, else EXL3_BATCH_INVARIANT. On turns the
    kernels' side on for the whole process (their shapes are chosen where they run)."""
    on = batch_invariant() if flag is None else bool(flag)
    if on and not batch_invariant():
        set_batch_invariant(True)
    return on


def max_jobs(max_batch: int, on: bool) -> int:
    """Jobs a generator runs at once: in the mode at most ``FUSED_MAX_ROWS`` (64), so a
    decode step never leaves the fused kernels' row range (the fused decode layer and
    GEMM take up to 64 rows; more would run other kernels for the same row)."""
    return min(max_batch, FUSED_MAX_ROWS) if on else max_batch


def decode_mode(mode: str | None, device: torch.device, on: bool) -> str | None:
    """The decode runner's mode: on a CPU, where the default is "off" (the general
    path), the mode needs the fixed-shape step: "static" unless a mode was named."""
    if on and mode is None and not os.environ.get("EXL3_DECODE_MODE", "").strip() \
            and torch.device(device).type != "cuda":
        return "static"
    return mode


def prompt_room(fed: list[tuple[Any, list[int]]], prompts_waiting: bool, max_rows: int,
                room: int) -> int:
    """Prompt tokens that fit beside the decode rows `fed` in one fixed-shape step of
    `max_rows` rows; with prompts waiting, drafts are shortened so that up to half the
    rows stay free for them (fit_rows)."""
    if prompts_waiting:
        fit_rows(fed, max_rows - min(room, max_rows // 2))
    used = sum(len(tokens) for _, tokens in fed)
    return max(0, min(room, max_rows - used))


def fits(fed: Sequence[tuple[Any, list[int]]], runner: Any) -> bool:
    """Whether this step's feeds (decode tokens, drafts, prompt chunks) run as one
    fixed-shape step: no prompt chunk with image spans, and the runner takes the rows."""
    if any(active.prefilling and active.keep_together for active, _ in fed):
        return False
    return runner.fits_feeds([(active.table, tokens) for active, tokens in fed])
