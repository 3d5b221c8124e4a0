"""The generator's side of the batch-invariant mode (ops/batch_invariant.py has the
kernels' side): every step, prompt chunks included, runs on the fixed-shape decode step,
one row per token, so a prompt token goes through the same arithmetic as a decoded one
and a job's logits do not depend on which jobs share its steps, how its prompt was cut
into chunks or whether its prefix came from the cache.

A prompt chunk rides beside the step's decode rows (and drafts) in the rows left of
``DecodeRunner.max_rows``; its last row gives the logits. What the mode does not
cover is refused where it is given: jobs with an adapter or image ids at submit
(``job_refusal``), mixture-of-experts and tensor-parallel models when the generator is
made (``model_refusal``); a step the fixed-shape step still cannot take (a model
without one) falls back to the general path. A generator in the mode runs at most 64
jobs at once (``max_jobs``); more wait in its queue.
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


def model_refusal(model: Any) -> str | None:
    """Why the mode cannot promise invariance for `model` (None: it can): mixture-of-
    experts layers (their expert grouping follows the batch) and tensor-parallel models
    keep kernels the mode does not cover, so the mode refuses them instead of running
    them unpromised."""
    from exl3cli.engine.generation.tp_driver import TensorParallelModel
    from exl3cli.engine.layers.moe import MoEMLP

    if isinstance(model, TensorParallelModel):
        return "batch-invariant mode does not cover tensor-parallel models"
    for layer in getattr(model, "layers", []):
        if any(isinstance(module, MoEMLP) for module in layer.modules()):
            return "batch-invariant mode does not cover mixture-of-experts layers"
    return None


def job_refusal(job: Any, prompt: Sequence[int], vocab_size: int) -> str | None:
    """Why a job cannot run invariantly (None: it can): LoRA adapters (their low-rank
    products keep their own kernels) and prompts with images (ids past the vocabulary:
    the fixed-shape step does not embed them)."""
    if job.adapter is not None:
        return "batch-invariant mode does not cover LoRA adapters"
    if any(token >= vocab_size for token in prompt):
        return "batch-invariant mode does not cover prompts with images"
    return None


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
