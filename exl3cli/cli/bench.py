"""`exl3 bench`: measure a server under load (`--server URL`) or a model's speed.

One command for every benchmark: with `--server` it replays chat requests against a
running Ollama/OpenAI-compatible server (cli/bench_load.py); with MODEL (a folder or a
stored name) or `--synthetic SHAPE -b BPW` it loads the model and measures prompt and
generation tokens/s, peak GPU memory and (on a GPU) the fraction of the memory-bandwidth
limit (cli/bench_speed.py); with `--ppl FILE` its perplexity (cli/bench_quality.py).
`--plot DIR` draws the report as PNG charts (cli/bench_plot.py); with `--from-json` it
draws earlier `--json` reports instead of running anything. SIGTERM stops it as Ctrl-C does, temporary files removed.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
from collections.abc import Iterator
from typing import Any

import click


@click.command("bench")
@click.argument("model_args", metavar="[MODEL]", nargs=-1)
@click.option("--server", metavar="URL",
              help="Benchmark a running server (ours, Ollama, or OpenAI-compatible).")
@click.option("--model", "model_name", metavar="NAME",
              help="Model the requests ask for (default: MODEL, else the server's first).")
@click.option("--concurrency", "-c", default=4, show_default=True,
              type=click.IntRange(1, 4096), help="Requests in flight at once.")
@click.option("--requests", "-n", "num_requests", default=32, show_default=True,
              type=click.IntRange(1, 1_000_000), help="Requests to send in all.")
@click.option("--prompt", default=None, help="The user message of every request.")
@click.option("--api", type=click.Choice(["ollama", "openai"]), default="ollama",
              show_default=True, help="Which API to speak.")
@click.option("--num-predict", default=64, show_default=True, type=click.IntRange(1),
              help="Tokens to generate per request (at most).")
@click.option("--temperature", default=0.0, show_default=True, type=float)
@click.option("--timeout", default=600.0, show_default=True, type=float,
              help="Seconds one request may take.")
@click.option("--api-key", envvar="EXL3_API_KEY", default=None,
              help="Bearer token (default: EXL3_API_KEY).")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@click.option("--prompt-lengths", default="512,2048", show_default=True,
              help="Speed mode: prompt lengths (tokens), comma-separated.")
@click.option("--gen-tokens", default=128, show_default=True, type=click.IntRange(1),
              help="Speed mode: tokens generated per measurement.")
@click.option("--batch", "batches", default="1,16", show_default=True,
              help="Speed mode: concurrent jobs of the generator (the path run and serve "
                   "take), comma-separated.")
@click.option("--synthetic", metavar="SHAPE", default=None,
              help="Speed mode: write a synthetic EXL3 model of this shape (llama3-8b, "
                   "llama3.2-1b, smollm2-135m, tiny, qwen3-30b-a3b, mixtral-8x7b) to a "
                   "temporary folder first.")
@click.option("-b", "--bits", default=4.0, show_default=True, type=float,
              help="With --synthetic: bits per weight.")
@click.option("--head-bits", default=6, show_default=True, type=int,
              help="With --synthetic: bits per weight of the output head.")
@click.option("--device", default=None, help="Speed mode: cuda or cpu (default: cuda if any).")
@click.option("--memory-context", default=8192, show_default=True, type=click.IntRange(0),
              help="Speed mode: cache size of the peak-memory run (0 skips it).")
@click.option("--no-graphs", is_flag=True,
              help="Speed mode: the generator's fixed-shape decode steps without CUDA graphs.")
@click.option("--ppl", "ppl_text", metavar="FILE", default=None,
              help="Quality mode: perplexity of MODEL over 2048-token windows of FILE "
                   "(e.g. wikitext-2 test.txt).")
@click.option("--kl-ref", metavar="MODEL", default=None,
              help="Quality mode: also the mean KL divergence and top-1 agreement "
                   "against this reference model, on the same tokens.")
@click.option("--windows", default=100, show_default=True, type=click.IntRange(1),
              help="Quality mode: how many windows (from the start of FILE).")
@click.option("--plot", "plot_dir", metavar="DIR", default=None,
              help="Also draw the report as PNG charts in DIR (created if missing; their "
                   "paths go to stderr): speed: tok/s vs concurrent jobs and prompt vs "
                   "generation tok/s; --ppl: perplexity and KL; --server: tok/s and time "
                   "to first token. Needs matplotlib (pip install 'exl3[plot]').")
@click.option("--from-json", "from_json", metavar="REPORT.json", multiple=True,
              help="With --plot: chart these earlier --json reports (several --ppl "
                   "reports give perplexity vs bpw) and run nothing; "
                   "`--from-json a.json b.json ...` takes them all.")
def bench(model_args: tuple[str, ...], server: str | None, model_name: str | None,
          concurrency: int, num_requests: int, prompt: str | None, api: str,
          num_predict: int, temperature: float, timeout: float, api_key: str | None,
          as_json: bool, prompt_lengths: str, gen_tokens: int, batches: str,
          synthetic: str | None, bits: float, head_bits: int, device: str | None,
          memory_context: int, no_graphs: bool, ppl_text: str | None, kl_ref: str | None,
          windows: int, plot_dir: str | None, from_json: tuple[str, ...]) -> None:
    """Benchmark a server under load (--server: requests/s, time to first token,
    latency percentiles, tokens/s, errors), or a model's speed (MODEL or --synthetic:
    prompt and generation tokens/s, peak GPU memory, fraction of the bandwidth limit),
    or its quality (MODEL --ppl FILE [--kl-ref MODEL]: perplexity, KL divergence).
    --plot DIR draws the report as PNG charts; --plot DIR --from-json A.json [B.json ...]
    charts earlier --json reports without running anything."""
    from exl3cli.cli.bench_load import LoadConfig, format_report, run_load

    if from_json:
        _plot_earlier_reports(plot_dir, [*from_json, *model_args],
                              server or ppl_text or kl_ref or synthetic)
        return
    if len(model_args) > 1:
        raise click.UsageError(f"give one MODEL, got {len(model_args)}: "
                               f"{' '.join(model_args)}")
    model_arg = model_args[0] if model_args else None
    if plot_dir is not None:
        _plots(None, plot_dir)  # matplotlib missing: say so before a long run
    if ppl_text or kl_ref:
        _plots(_quality_command(model_arg, ppl_text, kl_ref, windows, device, as_json),
               plot_dir)
        return
    if not server:
        _plots(_speed_command(model_arg, synthetic, bits, head_bits, _int_list(prompt_lengths),
                              gen_tokens, _int_list(batches), device, memory_context,
                              not no_graphs, as_json), plot_dir)
        return
    if "://" not in server:
        server = "http://" + server
    model = model_name or model_arg or _first_model(server, api, api_key)
    config = LoadConfig(server=server, model=model, requests=num_requests,
                        concurrency=concurrency, api=api, num_predict=num_predict,
                        temperature=temperature, timeout=timeout, api_key=api_key)
    if prompt:
        config.prompt = prompt
    report = run_load(config)
    if as_json:
        click.echo(json.dumps(report.as_dict(), indent=2))
    else:
        click.echo(format_report(report))
    if report.completed == 0:
        raise SystemExit(1)
    _plots(report.as_dict(), plot_dir)


def _plots(report: dict[str, Any] | None, plot_dir: str | None) -> None:
    """Draw `report` into `plot_dir` and name the files on stderr (no report: only check
    that matplotlib is there). Errors are one line, whichever way bench is invoked."""
    from exl3cli.cli import bench_plot
    from exl3cli.errors import Exl3Error

    if plot_dir is None:
        return
    try:
        if report is None:
            bench_plot.require_matplotlib()
            return
        for path in bench_plot.write_plots([report], plot_dir):
            click.echo(f"wrote {path}", err=True)
    except Exl3Error as error:
        raise click.ClickException(str(error)) from None


def _plot_earlier_reports(plot_dir: str | None, paths: list[str], runs: str | None) -> None:
    from exl3cli.cli import bench_plot
    from exl3cli.errors import Exl3Error

    if plot_dir is None:
        raise click.UsageError("--from-json needs --plot DIR")
    if runs:
        raise click.UsageError("--from-json charts earlier reports and runs nothing; "
                               "drop --server, --ppl, --kl-ref and --synthetic")
    try:
        bench_plot.require_matplotlib()
        for path in bench_plot.write_plots(bench_plot.load_reports(paths), plot_dir):
            click.echo(f"wrote {path}", err=True)
    except Exl3Error as error:
        raise click.ClickException(str(error)) from None


def _first_model(server: str, api: str, api_key: str | None) -> str:
    """The first model the server lists, for when none is named."""
    import urllib.error
    import urllib.request

    path = "/v1/models" if api == "openai" else "/api/tags"
    request = urllib.request.Request(server.rstrip("/") + path)
    key = api_key or os.environ.get("EXL3_API_KEY")
    if key:
        request.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            listed = json.loads(response.read())
    except (urllib.error.URLError, OSError, ValueError) as error:
        raise click.ClickException(f"cannot list models at {server}: {error}") from None
    names = [m.get("id") for m in listed.get("data", [])] if api == "openai" else \
        [m.get("name") for m in listed.get("models", [])]
    if not names:
        raise click.ClickException(f"{server} lists no models; name one with --model")
    return str(names[0])


def _int_list(text: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise click.BadParameter(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise click.BadParameter(f"expected positive integers, got {text!r}")
    return values


def _speed_command(model_arg: str | None, synthetic: str | None, bits: float, head_bits: int,
                   prompt_lengths: list[int], gen_tokens: int, batches: list[int],
                   device: str | None, memory_context: int, graphs: bool,
                   as_json: bool) -> dict[str, Any]:
    import tempfile
    from pathlib import Path

    from exl3cli.cli.bench_speed import format_speed_report, run_speed

    if synthetic is None and model_arg is None:
        raise click.UsageError("give MODEL, --synthetic SHAPE, or --server URL")
    with exit_on_sigterm(), tempfile.TemporaryDirectory(prefix="exl3-bench-") as scratch:
        if synthetic is not None:
            from exl3cli.convert.synthetic import SHAPES, write_synthetic_model

            if synthetic not in SHAPES:
                raise click.BadParameter(f"unknown shape {synthetic!r}; choose from "
                                         f"{', '.join(sorted(SHAPES))}")
            folder = write_synthetic_model(Path(scratch) / synthetic, synthetic, bits=bits,
                                           head_bits=head_bits)
            label = f"synthetic {synthetic} {bits:g} bpw (head {head_bits})"
        else:
            folder, label = _model_folder(model_arg), model_arg
        report = run_speed(folder, prompt_lengths=prompt_lengths, gen_tokens=gen_tokens,
                           batches=batches, device=device, memory_context=memory_context,
                           graphs=graphs, label=label)
    click.echo(json.dumps(report, indent=2) if as_json else format_speed_report(report))
    return report


@contextlib.contextmanager
def exit_on_sigterm() -> Iterator[None]:
    """SIGTERM ends the command like Ctrl-C does, running its cleanup (a synthetic model
    is several GB of temporary files) instead of dying on the spot."""
    def terminate(signum: int, _frame: Any) -> None:
        raise SystemExit(128 + signum)

    try:
        previous = signal.signal(signal.SIGTERM, terminate)
    except ValueError:  # not the main thread: leave signals alone
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _quality_command(model_arg: str | None, ppl_text: str | None, kl_ref: str | None,
                     windows: int, device: str | None, as_json: bool) -> dict[str, Any]:
    from exl3cli.cli.bench_quality import format_quality_report, run_quality

    if model_arg is None or ppl_text is None:
        raise click.UsageError("quality mode needs MODEL and --ppl FILE")
    reference = _model_folder(kl_ref) if kl_ref else None
    report = run_quality(_model_folder(model_arg), ppl_text, windows=windows,
                         reference=reference, device=device)
    click.echo(json.dumps(report, indent=2) if as_json else format_quality_report(report))
    return report


def _model_folder(model_arg: str):
    from pathlib import Path

    path = Path(model_arg).expanduser()
    if path.is_dir():
        return path
    from exl3cli.store.store import ModelStore

    return ModelStore().model_folder(model_arg)


COMMANDS = [bench]
