"""`exl3 pull` through the real CLI, client and store against the local hub."""

from __future__ import annotations

import io

import pytest
from click.testing import CliRunner

from exl3cli.cli import main
from exl3cli.cli.progress import show_progress
from exl3cli.cli.pull import PullProgress
from exl3cli.errors import PullError
from exl3cli.store.store import ModelStore
from tests.fixtures.local_hub import LocalHub
from tests.fixtures.tiny_model import write_tiny_model
from tests.fixtures.tiny_store import write_tiny_chat_model
from tests.fixtures.tiny_tokenizer import write_tiny_tokenizer


def test_pull_command_stores_the_model_and_shows_progress(tmp_path, monkeypatch):
    repo = write_tiny_model(tmp_path / "repo", "llama")
    write_tiny_tokenizer(repo)
    monkeypatch.setenv("EXL3_MODELS", str(tmp_path / "store"))
    with LocalHub() as hub:
        hub.add_repo("someone/tiny", repo)
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        result = CliRunner().invoke(main, ["pull", "hf.co/someone/tiny"])
    assert result.exit_code == 0, result.output
    assert result.stdout == ""  # progress goes to stderr only
    assert "pulling manifest" in result.stderr and result.stderr.rstrip().endswith("success")
    assert "writing manifest" in result.stderr
    stored = ModelStore(tmp_path / "store").read_manifest("hf.co/someone/tiny")
    assert "model.safetensors" in stored.files


def test_pull_unknown_model_is_a_one_line_error(tmp_path, monkeypatch):
    monkeypatch.setenv("EXL3_MODELS", str(tmp_path / "store"))
    result = CliRunner().invoke(main, ["pull", "nosuchmodel:1b"])
    assert result.exit_code == 1
    last = result.stderr.strip().splitlines()[-1]  # after "pulling manifest", as in Ollama
    assert last.startswith("Error: ") and "not in the catalog" in last
    assert "Traceback" not in result.stderr


def test_progress_bars_follow_completed_counts():
    stream = io.StringIO()
    progress = PullProgress(stream, tty=True)
    progress({"status": "pulling manifest"})
    for done in (0, 512, 1024):
        progress({"status": "pulling abc", "digest": "sha256:abc", "total": 1024, "completed": done})
    bar = next(iter(progress._bars.values()))
    assert bar.n == 1024 and bar.total == 1024
    progress({"status": "success"})
    text = stream.getvalue()
    assert text.startswith("pulling manifest\n") and "1.00k" in text.lower()
    assert text.rstrip().endswith("success")


def test_off_a_terminal_progress_is_plain_lines_each_once():
    stream = io.StringIO()
    show_progress([{"status": "pulling manifest"}]
                  + [{"status": "pulling abc", "digest": "sha256:abc", "total": 2_000_000,
                      "completed": done} for done in (0, 1_000_000, 2_000_000, 2_000_000)]
                  + [{"status": "verifying sha256 digest"}, {"status": "success"}], stream)
    assert stream.getvalue() == ("pulling manifest\npulling abc 2.0 MB\n"
                                 "verifying sha256 digest\nsuccess\n")
    with pytest.raises(PullError, match="disk full"):
        show_progress([{"status": "pulling manifest"}, {"error": "disk full"}], io.StringIO())


def test_pull_and_the_pull_inside_run_print_the_same(tmp_path, monkeypatch):
    repo = write_tiny_chat_model(tmp_path / "repo")
    with LocalHub() as hub:
        hub.add_repo("someone/tiny", repo)
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        monkeypatch.setenv("EXL3_MODELS", str(tmp_path / "a"))
        pulled = CliRunner().invoke(main, ["pull", "hf.co/someone/tiny"])
        monkeypatch.setenv("EXL3_MODELS", str(tmp_path / "b"))
        ran = CliRunner().invoke(main, ["run", "hf.co/someone/tiny", "hi"])
    assert pulled.exit_code == 0 and ran.exit_code == 0, ran.output
    assert "\x1b" not in pulled.stderr and "\r" not in pulled.stderr
    assert ran.stderr.startswith(pulled.stderr)  # then the answer's own stderr, if any


def test_pulling_a_present_model_again_is_quick(tmp_path, monkeypatch):
    repo = write_tiny_model(tmp_path / "repo", "llama")
    write_tiny_tokenizer(repo)
    monkeypatch.setenv("EXL3_MODELS", str(tmp_path / "store"))
    with LocalHub() as hub:
        hub.add_repo("someone/tiny", repo)
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        assert CliRunner().invoke(main, ["pull", "hf.co/someone/tiny"]).exit_code == 0
    # the hub is gone: a second pull must not need it
    again = CliRunner().invoke(main, ["pull", "hf.co/someone/tiny"])
    assert again.exit_code == 0, again.output
    assert again.stderr == "pulling manifest\nusing existing layers\nsuccess\n"
