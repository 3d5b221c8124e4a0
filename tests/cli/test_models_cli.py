"""`exl3 list/ls/show/cp/rm/create` end to end against a temporary store."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
from click.testing import CliRunner

from exl3cli.cli import main
from exl3cli.store.modelfile import parse_modelfile
from exl3cli.store.store import ModelStore
from tests.store.test_store import store_snapshot, write_hf_folder

BASE_MODELFILE = '''FROM ./hf
PARAMETER stop "<|im_end|>"
PARAMETER top_k 20
SYSTEM """You are tiny.
Answer briefly."""
TEMPLATE """{% for m in messages %}{{ m.content }}{% endfor %}"""
LICENSE """Tiny License
second line
third line"""
'''


@pytest.fixture
def workspace(tmp_path: Path, monkeypatch) -> Path:
    """A store in tmp_path/store and a tiny model folder next to a Modelfile."""
    monkeypatch.setenv("EXL3_MODELS", str(tmp_path / "store"))
    monkeypatch.chdir(tmp_path)
    write_hf_folder(tmp_path / "hf")
    (tmp_path / "Base.Modelfile").write_text(BASE_MODELFILE)
    return tmp_path


def exl3(*args: str):
    result = CliRunner().invoke(main, list(args))
    if result.exception and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result


def create_base(workspace: Path) -> None:
    result = exl3("create", "smollm2:135m", "-f", str(workspace / "Base.Modelfile"))
    assert result.exit_code == 0, result.stderr
    assert result.stderr.strip().splitlines()[-1] == "success"


def list_rows(command: str = "list") -> dict[str, list[str]]:
    result = exl3(command)
    assert result.exit_code == 0
    header, *rows = result.stdout.splitlines()
    assert header.split() == ["NAME", "ID", "SIZE", "MODIFIED"]
    return {row.split()[0]: row.split()[1:] for row in rows}


def test_create_from_store_name_shares_weights(workspace):
    create_base(workspace)
    blobs = set(os.listdir(workspace / "store" / "blobs"))
    (workspace / "Mf").write_text("PARAMETER temperature 0\nFROM smollm2:135m\n")
    result = exl3("create", "smol0", "-f", "Mf")
    assert result.exit_code == 0, result.stderr
    assert set(os.listdir(workspace / "store" / "blobs")) == blobs  # no weights copied
    rows = list_rows()
    assert set(rows) == {"smollm2:135m", "smol0:latest"}
    assert rows["smol0:latest"][0] != rows["smollm2:135m"][0]
    assert rows["smol0:latest"][1:3] == rows["smollm2:135m"][1:3]  # same size
    assert list_rows("ls") == rows
    manifest = ModelStore().read_manifest("smol0")
    # The new PARAMETER is added; those of the base stay; the rest is inherited.
    assert manifest.parameters == {"stop": ["<|im_end|>"], "top_k": 20, "temperature": 0.0}
    assert manifest.system == "You are tiny.\nAnswer briefly."
    assert manifest.files == ModelStore().read_manifest("smollm2:135m").files


def test_show_modelfile_round_trips(workspace):
    create_base(workspace)
    (workspace / "Mf").write_text('FROM smollm2:135m\nPARAMETER temperature 0\n'
                                  'MESSAGE user "say \\"hi\\""\nMESSAGE assistant """hi\n"""\n')
    assert exl3("create", "smol0", "-f", "Mf").exit_code == 0
    shown = exl3("show", "smol0", "--modelfile")
    assert shown.exit_code == 0
    assert parse_modelfile(shown.stdout).from_ == "smol0:latest"
    (workspace / "Shown").write_text(shown.stdout)
    result = exl3("create", "smol1", "-f", "Shown")
    assert result.exit_code == 0, result.stderr
    rows = list_rows()
    assert rows["smol1:latest"][0] == rows["smol0:latest"][0]  # identical manifests
    again = exl3("show", "smol1", "--modelfile").stdout
    assert again.replace("smol1:latest", "smol0:latest") == shown.stdout
    store = ModelStore()
    assert store.read_manifest("smol1").messages == [
        {"role": "user", "content": 'say "hi"'}, {"role": "assistant", "content": "hi\n"}]


def test_show_sections_and_fields(workspace):
    create_base(workspace)
    summary = exl3("show", "smollm2:135m").stdout
    for fragment in ("Model", "architecture", "llama", "context length", "256",
                     "embedding length", "Parameters", "top_k", "System", "You are tiny.",
                     "License", "Tiny License", "F32"):
        assert fragment in summary
    assert "third line" not in summary  # long licenses are cut in the summary
    parameters = exl3("show", "smollm2:135m", "--parameters").stdout.splitlines()
    assert [line.split(None, 1) for line in parameters] == [["stop", '"<|im_end|>"'],
                                                            ["top_k", "20"]]
    assert exl3("show", "smollm2:135m", "--system").stdout == "You are tiny.\nAnswer briefly.\n"
    assert exl3("show", "smollm2:135m", "--template").stdout == (
        "{% for m in messages %}{{ m.content }}{% endfor %}\n")
    assert exl3("show", "smollm2:135m", "--license").stdout.startswith("Tiny License\n")


def test_copy_and_remove(workspace):
    create_base(workspace)
    blobs = set(os.listdir(workspace / "store" / "blobs"))
    result = exl3("cp", "smollm2:135m", "me/copy:v1")
    assert result.exit_code == 0
    assert result.stdout == "copied 'smollm2:135m' to 'me/copy:v1'\n"
    assert set(list_rows()) == {"smollm2:135m", "me/copy:v1"}
    assert exl3("rm", "smollm2:135m").stdout == "deleted 'smollm2:135m'\n"
    assert set(os.listdir(workspace / "store" / "blobs")) == blobs  # still used by the copy
    assert exl3("rm", "me/copy:v1").exit_code == 0
    assert os.listdir(workspace / "store" / "blobs") == []
    assert list_rows() == {}


BAD_MODELFILES = {
    "bad line": "FROM ./hf\nPARAMETER top_k many\n",
    "unknown parameter": "FROM ./hf\nPARAMETER warp_speed 9\n",
    "missing folder": "FROM ./no-such-folder\n",
    "not a model folder": "FROM ./hf/extra\n",
    "bad FROM name": "FROM bad..name\n",
    "unknown FROM model": "FROM nothing-here:v9\n",
}


@pytest.mark.parametrize("args, message", [
    (["show", "nothing-here"], "model 'nothing-here:latest' not found"),
    (["show", "../etc/passwd"], "invalid model name"),
    (["cp", "nothing-here", "x"], "not found"),
    (["cp", "smollm2:135m", "bad/../name"], "invalid model name"),
    (["rm", "smollm2:135m", "nothing-here"], "not found"),
    (["rm", "a\\b"], "invalid model name"),
    (["create", "x", "-f", "no-such-Modelfile"], "no Modelfile"),
    (["create", "bad..name", "-f", "Base.Modelfile"], "invalid model name"),
    *[(["create", "x", "-f", name], fragment) for name, fragment in [
        ("bad line", "Modelfile line 2: parameter 'top_k' needs an integer"),
        ("unknown parameter", "Modelfile line 2: unknown parameter 'warp_speed'"),
        ("missing folder", "Modelfile line 1: FROM ./no-such-folder: no such file"),
        ("not a model folder", "no config.json"),
        ("bad FROM name", "Modelfile line 1: invalid model name"),
        ("unknown FROM model", "nothing-here:v9"),
    ]],
])
def test_errors_are_one_line_and_leave_the_store_alone(workspace, args, message):
    create_base(workspace)
    for name, text in BAD_MODELFILES.items():
        (workspace / name).write_text(text)
    before = store_snapshot(workspace / "store")
    result = exl3(*args)
    assert result.exit_code == 1
    assert result.stdout == ""
    assert result.stderr.splitlines()[-1].startswith("Error: ")
    assert message in result.stderr.splitlines()[-1]
    assert len([line for line in result.stderr.splitlines() if line.startswith("Error")]) == 1
    assert store_snapshot(workspace / "store") == before


def test_installed_command(workspace):
    command = shutil.which("exl3")
    assert command, "the exl3 console script is not installed"
    env = {**os.environ, "EXL3_MODELS": str(workspace / "store")}
    (workspace / "Mf").write_text("FROM ./hf\nPARAMETER temperature 0\n")
    run = lambda *args: subprocess.run([command, *args], cwd=workspace, env=env,  # noqa: E731
                                       capture_output=True, text=True, timeout=120)
    created = run("create", "tiny", "-f", "Mf")
    assert created.returncode == 0, created.stderr
    listed = run("list")
    assert listed.returncode == 0
    assert listed.stdout.splitlines()[1].startswith("tiny:latest ")
    missing = run("show", "nothing-here")
    assert missing.returncode == 1
    assert missing.stdout == ""
    assert missing.stderr == "Error: model 'nothing-here:latest' not found\n"


def test_create_from_a_gguf_file(workspace):
    from tests.fixtures.tiny_gguf import write_tiny_gguf

    (workspace / "models").mkdir()
    write_tiny_gguf(workspace / "models" / "tiny.gguf")
    (workspace / "models" / "Modelfile").write_text("FROM tiny.gguf\nPARAMETER num_ctx 64\n")
    result = exl3("create", "from-gguf", "-f", str(workspace / "models" / "Modelfile"))
    assert result.exit_code == 0, result.stderr
    store = ModelStore()
    manifest = store.read_manifest("from-gguf")
    assert manifest.source == {"type": "gguf", "path": str(workspace / "models" / "tiny.gguf")}
    assert "config.json" in manifest.files
    assert any(name.endswith(".safetensors") for name in manifest.files)
    folder = store.model_folder("from-gguf")
    assert (folder / "config.json").is_file()
    assert not [p for p in store.root.iterdir() if p.name.startswith(".convert-")]
    assert "from-gguf:latest" in list_rows()


def test_draft_paths_become_absolute_and_a_missing_adapter_is_refused(workspace):
    create_base(workspace)
    (workspace / "sub").mkdir()
    (workspace / "sub" / "Mf").write_text("FROM smollm2:135m\nDRAFT ../hf\n")
    assert exl3("create", "drafted", "-f", "sub/Mf").exit_code == 0
    manifest = ModelStore().read_manifest("drafted")
    assert manifest.draft == str(workspace / "hf")
    (workspace / "Mf2").write_text("FROM drafted\nDRAFT smollm2:135m\n")
    assert exl3("create", "drafted2", "-f", "Mf2").exit_code == 0
    assert ModelStore().read_manifest("drafted2").draft == "smollm2:135m"
    (workspace / "Mf3").write_text("FROM drafted\nADAPTER ./lora\n")
    refused = exl3("create", "adapted", "-f", "Mf3")
    assert refused.exit_code == 1 and "line 2" in refused.stderr
    assert "ADAPTER ./lora: no such folder" in refused.stderr
    assert not ModelStore().exists("adapted")


def test_create_pulls_a_missing_from_model_first(workspace, monkeypatch):
    from tests.fixtures.local_hub import LocalHub

    with LocalHub() as hub:
        hub.add_repo("someone/tiny", workspace / "hf")
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        (workspace / "Mf").write_text("FROM hf.co/someone/tiny\nPARAMETER temperature 0.1\n")
        result = exl3("create", "mine", "-f", "Mf")
    assert result.exit_code == 0, result.stderr
    statuses = result.stderr.splitlines()
    assert "pulling manifest" in statuses
    assert statuses.count("success") == 1 and statuses[-1] == "success"
    rows = list_rows()
    assert set(rows) == {"hf.co/someone/tiny:latest", "mine:latest"}
    store = ModelStore()
    assert store.read_manifest("mine").files == store.read_manifest("hf.co/someone/tiny").files
    assert store.read_manifest("mine").parameters == {"temperature": 0.1}


@pytest.mark.parametrize("size, text", [
    (0, "0 B"), (999, "999 B"), (1_400, "1.4 KB"), (270_000_000, "270 MB"),
    (4_700_000_000, "4.7 GB"), (40_000_000_000, "40 GB"), (12_345_678_901_234, "12 TB"),
])
def test_human_size(size, text):
    from exl3cli.cli.models import human_size

    assert human_size(size) == text


@pytest.mark.parametrize("seconds, text", [
    (0.4, "Less than a second ago"), (1, "1 second ago"), (42, "42 seconds ago"),
    (90, "About a minute ago"), (600, "10 minutes ago"), (3700, "About an hour ago"),
    (2 * 3600 + 5, "2 hours ago"), (3 * 86400, "3 days ago"), (15 * 86400, "2 weeks ago"),
    (400 * 86400, "1 year ago"),
])
def test_human_ago(seconds, text):
    from datetime import datetime, timedelta, timezone

    from exl3cli.cli.models import human_ago

    now = datetime(2026, 1, 1, tzinfo=timezone.utc)
    assert human_ago(now - timedelta(seconds=seconds), now) == text


def test_table_columns_are_left_aligned_without_borders():
    from exl3cli.cli.models import format_table

    table = format_table(["NAME", "ID"], [["a-long-name:latest", "abc"], ["b:1", "def"]])
    lines = table.splitlines()
    assert [line.index(cell) for line, cell in zip(lines, ["ID", "abc", "def"], strict=True)] \
        == [len("a-long-name:latest") + 4] * 3
    assert not any(char in table for char in "|+")


def test_show_template_prints_the_models_own_template_without_a_TEMPLATE(workspace):
    from exl3cli.engine.text.chat_template import ChatTemplate
    from tests.fixtures.tiny_store import write_tiny_chat_model

    folder = write_tiny_chat_model(workspace / "chat")
    (workspace / "Chat.Modelfile").write_text("FROM ./chat\n")
    assert exl3("create", "chat", "-f", "Chat.Modelfile").exit_code == 0
    own = ChatTemplate.from_folder(folder).source
    assert own and exl3("show", "chat", "--template").stdout == own + "\n"
    modelfile = exl3("show", "chat", "--modelfile").stdout
    assert "TEMPLATE" not in modelfile  # the model's own template is not copied into it


def test_create_with_an_adapter_and_show_lists_it(tmp_path, monkeypatch):
    from tests.engine.test_lora import make_adapter
    from tests.fixtures.tiny_model import tiny_reference_model, write_tiny_model

    monkeypatch.setenv("EXL3_MODELS", str(tmp_path / "store"))
    monkeypatch.chdir(tmp_path)
    write_tiny_model(tmp_path / "base", "llama")
    make_adapter(tiny_reference_model("llama"), tmp_path / "lora", seed=1)
    make_adapter(tiny_reference_model("llama", hidden_size=96), tmp_path / "wide", seed=1)
    (tmp_path / "Mf").write_text("FROM ./base\nADAPTER ./lora\n")
    created = exl3("create", "adapted", "-f", "Mf")
    assert created.exit_code == 0, created.stderr
    shown = exl3("show", "adapted").stdout
    assert f"  Adapter\n    {tmp_path / 'lora'}\n" in shown
    assert f"ADAPTER {tmp_path / 'lora'}" in exl3("show", "adapted", "--modelfile").stdout
    (tmp_path / "Mf2").write_text("FROM ./base\nADAPTER ./wide\n")
    refused = exl3("create", "wide", "-f", "Mf2")
    assert refused.exit_code == 1
    assert "Error: Modelfile line 2: adapter " in refused.stderr
    assert "shape mismatch at model.layers.0." in refused.stderr
    assert "ADAPTER" in exl3("create", "--help").stdout
