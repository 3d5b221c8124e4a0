"""`exl3 serve` (the daemon), `exl3 ps` (loaded models) and `exl3 stop MODEL`."""

from __future__ import annotations

import logging
from datetime import datetime, timedelta, timezone
from typing import Any

import click

from exl3cli.errors import Exl3Error, InvalidModelName

SHUTDOWN_SECONDS = 10  # how long running streams get to finish after SIGTERM


def _serve_help() -> str:
    from exl3cli.server.limits import LIMIT_VARIABLES

    rows = [("EXL3_HOST", "where to listen (default 127.0.0.1:11435)"),
            ("EXL3_TENSOR_PARALLEL", "split each model over N GPUs (--tp)"),
            ("EXL3_GPU_SPLIT", "whole layers per GPU: auto or GiB,GiB,... (--gpu-split)"),
            ("EXL3_TP_TIMEOUT", "seconds a tensor-parallel collective may wait for a rank "
                                "(default 300)"),
            ("EXL3_MODELS", "the model store (default ~/.exl3/models)"),
            ("EXL3_API_KEY", "require Authorization: Bearer <key>"),
            ("EXL3_ADMIN_KEY", "when set, loading models and store writes need this key"),
            ("EXL3_ORIGINS", "browser origins allowed besides the local ones "
                             "(comma-separated, * wildcards); others get 403"),
            ("EXL3_LORA_DIR", "LoRA folders /v1/lora/load finds by name "
                              "(default ~/.exl3/loras)"),
            ("EXL3_KEEP_ALIVE", "how long an idle model stays loaded (default 5m)"),
            ("EXL3_NUM_PARALLEL", "jobs one model runs at once (default 4)"),
            ("EXL3_MAX_QUEUE", "jobs that may wait per model weights (default 512; then 503)"),
            ("EXL3_MAX_LOADED_MODELS", "models loaded at once (default 1)"),
            ("EXL3_LOG_LEVEL", "debug: also log loads, evictions and CUDA graph captures"),
            ("EXL3_GIL_SWITCH_MS", "Python's thread switch interval in ms (default 5): "
                                   "smaller may help several models' generator threads"),
            ("EXL3_SERVE_RELAY", "thread: the older per-token relay instead of one "
                                 "hand-off per generator step (A/B)"),
            ("EXL3_KV_CACHE_TYPE", "fp16, q8, q6, q4 or e.g. k8v4 (default fp16)"),
            ("EXL3_DECODE_MODE", "graph (GPU default), static or off (CPU default)"),
            ("EXL3_FUSED_LAYER", "0: GPU decode without the fused layer kernels (A/B)"),
            ("EXL3_PROMPT_BESIDE", "0: short prompts take the general path, not the "
                                   "decode step beside running jobs (A/B)"),
            ("EXL3_BESIDE_IN_TURN", "0: several short prompts waiting ride beside only "
                                    "when short together (A/B)"),
            ("EXL3_VERIFY_AHEAD", "0: a speculative pass's next step waits for its "
                                  "text work (A/B)"),
            ("EXL3_PDL", "1: programmatic dependent launch of the GPU kernels (opt-in)"),
            ("EXL3_BATCH_INVARIANT", "1: a job's tokens do not depend on the jobs beside "
                                     "it (--batch-invariant)"),
            ("EXL3_CPU_WEIGHTS", "exl3 (compressed, default with the CPU kernels), fp32, "
                                 "bf16 or int8 weights on the CPU"),
            ("EXL3_NO_EXT", "1: pure-PyTorch paths, no compiled kernels"),
            *LIMIT_VARIABLES,
            ("EXL3_TEMPLATE_TIMEOUT", "seconds a chat template may render (default 5)"),
            ("EXL3_TEMPLATE_MAX_BYTES", "characters a chat template may produce "
                                        "(default 32 MiB)"),
            ("HF_TOKEN, HF_ENDPOINT", "passed to huggingface_hub for pulls")]
    lines = "\n".join(f"  {name}: {meaning}" for name, meaning in rows)
    return ("Start the daemon (Ollama, OpenAI and TabbyAPI routes) on EXL3_HOST.\n\n"
            f"\b\nEnvironment:\n{lines}\n\nOn SIGTERM running streams get "
            f"{SHUTDOWN_SECONDS} s to finish.")


def gil_switch_seconds(text: str) -> float | None:
    """EXL3_GIL_SWITCH_MS as seconds for sys.setswitchinterval; None when unset.
    Two models' generator threads each wait on the GPU and then on the GIL: a shorter
    interval shortens the second wait (an A/B knob until measured: bench/NOTES-serve.md)."""
    text = text.strip()
    if not text:
        return None
    try:
        ms = float(text)
    except ValueError:
        ms = -1.0
    if not 0.01 <= ms <= 1000:
        raise Exl3Error(f"EXL3_GIL_SWITCH_MS must be milliseconds from 0.01 to 1000, got {text!r}")
    return ms / 1000


@click.command("serve", help=_serve_help())
@click.option("--tp", "tensor_parallel", type=click.IntRange(min=1), default=None,
              help="Tensor-parallel width: split each model over this many GPUs, one "
                   "process each (on a machine without GPUs: CPU processes over gloo). "
                   "Same as EXL3_TENSOR_PARALLEL; PARAMETER tensor_parallel overrides it.")
@click.option("--gpu-split", default=None, metavar="auto|GiB,GiB,...",
              help="Layer split: whole layers on the GPUs in turn, sized from their free "
                   "memory (auto) or the GiB given per GPU. Same as EXL3_GPU_SPLIT.")
@click.option("--batch-invariant", is_flag=True, default=False,
              help="Batch-invariant decoding: a job's logits, and so its greedy text, are "
                   "the same alone or beside any other jobs (prompts are prefilled on the "
                   "decode step, one row per token, at most 64 jobs per model; long "
                   "prompts slower, one-job decoding ~3% slower on 8B shapes, estimated). "
                   "Same as EXL3_BATCH_INVARIANT=1.")
def serve(tensor_parallel: int | None, gpu_split: str | None, batch_invariant: bool) -> None:
    """Start the daemon (its help, with the environment it reads: _serve_help)."""
    import os

    from aiohttp import web

    from exl3cli.ops.batch_invariant import parse_flag

    if batch_invariant:
        os.environ["EXL3_BATCH_INVARIANT"] = "1"
    try:
        parse_flag(os.environ.get("EXL3_BATCH_INVARIANT", ""))
    except ValueError as error:
        raise Exl3Error(str(error)) from None

    switch = gil_switch_seconds(os.environ.get("EXL3_GIL_SWITCH_MS", ""))
    if switch is not None:
        import sys

        sys.setswitchinterval(switch)

    if tensor_parallel is not None:
        os.environ["EXL3_TENSOR_PARALLEL"] = str(tensor_parallel)
    if gpu_split is not None:
        from exl3cli.engine.models.layer_split import parse_gpu_split

        parse_gpu_split(gpu_split)  # a bad value fails here, not at the first load
        os.environ["EXL3_GPU_SPLIT"] = gpu_split

    from exl3cli import __version__
    from exl3cli.hostaddr import parse_host
    from exl3cli.server.app import create_app

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    level = os.environ.get("EXL3_LOG_LEVEL", "").strip().upper()
    if level in ("DEBUG", "INFO", "WARNING", "ERROR"):  # the daemon's own lines only
        logging.getLogger("exl3cli").setLevel(level)
    host = parse_host()
    # Streams get the grace period to finish; a second is left to send their last line.
    app = create_app(host=host, shutdown_grace=SHUTDOWN_SECONDS - 1)

    def announce(*_args: Any, **_kwargs: Any) -> None:
        click.echo(f"exl3 {__version__} listening on {host.url}", err=True)

    try:
        # run_app turns SIGINT/SIGTERM into a graceful exit: stop accepting, let the
        # manager cancel running jobs so their streams end, then return (status 0).
        web.run_app(app, host=host.host, port=host.port, print=announce,
                    shutdown_timeout=SHUTDOWN_SECONDS, access_log=None)
    except OSError as error:
        raise Exl3Error(f"could not listen on {host.url}: {error.strerror or error}") from None


def _client() -> Any:
    """The daemon's client when one answers at EXL3_HOST (only a daemon has models
    loaded between commands), else the usual one."""
    from exl3cli.client import get_client
    from exl3cli.client.http import HttpClient, daemon_url

    url = daemon_url()
    return HttpClient(url) if url else get_client()


def processor_text(model: dict[str, Any]) -> str:
    """Where the weights live, as Ollama prints it: `100% GPU`, `100% CPU`, or a split."""
    size = int(model.get("size") or 0)
    vram = int(model.get("size_vram") or 0)
    if size <= 0 or vram <= 0:
        return "100% CPU"
    if vram >= size:
        return "100% GPU"
    gpu = round(100 * vram / size)
    return f"{100 - gpu}%/{gpu}% CPU/GPU"


def until_text(expires_at: str | None, now: datetime | None = None) -> str:
    """`4 minutes from now`, `Forever` (keep_alive < 0), `Stopping...` once past."""
    from exl3cli.cli.models import human_ago

    if not expires_at:
        return "Forever"
    now = now or datetime.now(timezone.utc)
    expires = datetime.fromisoformat(expires_at.replace("Z", "+00:00"))
    left = expires - now
    if left > timedelta(days=365 * 50):
        return "Forever"
    if left.total_seconds() <= 0:
        return "Stopping..."
    # human_ago counts backwards; mirror the instant to reuse its wording.
    return human_ago(now - left, now).replace(" ago", " from now")


@click.command("ps")
def ps() -> None:
    """List the models loaded in the daemon."""
    from exl3cli.cli.models import format_table, human_size

    rows = []
    for model in _client().ps().get("models", []):
        context = model.get("context_length")
        rows.append([model.get("name") or model.get("model", ""),
                     str(model.get("digest", ""))[:12], human_size(int(model.get("size") or 0)),
                     processor_text(model), str(context) if context else "",
                     until_text(model.get("expires_at"))])
    click.echo(format_table(["NAME", "ID", "SIZE", "PROCESSOR", "CONTEXT", "UNTIL"], rows))


def _canonical(name: str) -> str:
    from exl3cli.store.names import ModelName

    try:
        return str(ModelName.parse(name))
    except InvalidModelName:
        return name


@click.command("stop")
@click.argument("model")
def stop(model: str) -> None:
    """Unload MODEL from the daemon now."""
    client = _client()
    wanted = _canonical(model)
    loaded = [m for m in client.ps().get("models", [])
              if wanted in (_canonical(m.get("name") or ""), _canonical(m.get("model") or ""))]
    if not loaded:
        raise Exl3Error(f"couldn't find model \"{model}\" to stop")
    for _ in client.generate({"model": model, "keep_alive": 0}):
        pass


COMMANDS = [serve, ps, stop]
