"""`exl3 bench`: measure a server under load (`--server URL`).

One command for every benchmark: with `--server` it replays chat requests against a
running Ollama/OpenAI-compatible server (cli/bench_load.py); the quality and speed
modes of a local model (`exl3 bench MODEL --ppl ...`) will hang off the MODEL argument.
"""

from __future__ import annotations

import json
import os

import click


@click.command("bench")
@click.argument("model_arg", metavar="[MODEL]", required=False)
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
def bench(model_arg: str | None, server: str | None, model_name: str | None,
          concurrency: int, num_requests: int, prompt: str | None, api: str,
          num_predict: int, temperature: float, timeout: float, api_key: str | None,
          as_json: bool) -> None:
    """Benchmark a server under load: requests/s, time to first token, latency
    percentiles, tokens/s and errors."""
    from exl3cli.cli.bench_load import LoadConfig, format_report, run_load

    if not server:
        raise click.UsageError("give --server URL (local-model benchmarks of MODEL are "
                               "not available yet)")
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


COMMANDS = [bench]
