"""The REPL: its line logic directly, the real prompt_toolkit loop through a pipe, and
the real `exl3 run` on a pseudo-terminal (Ctrl-C, Ctrl-D)."""

from __future__ import annotations

import io
import os
import sys
import time

import pexpect
import pytest
from click.testing import CliRunner
from prompt_toolkit.input import create_pipe_input
from prompt_toolkit.output import DummyOutput

from exl3cli.cli import main
from exl3cli.cli.repl import Repl
from exl3cli.cli.repl_commands import ReplOptions, ReplProcessor, ReplSession
from exl3cli.client.local import LocalClient
from exl3cli.store.modelfile import parse_modelfile
from tests.fixtures.tiny_store import make_tiny_store


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    # A long context so that an answer can run long enough to be interrupted.
    return make_tiny_store(tmp_path_factory.mktemp("repl"), max_position_embeddings=4096)


@pytest.fixture(scope="module")
def client(store):
    return LocalClient(store)


@pytest.fixture
def processor(client):
    return ReplProcessor(ReplSession(model="tiny"), client)


def answer_of(client, messages, options):
    chunks = client.chat({"model": "tiny", "messages": messages, "options": options})
    return "".join(c["message"]["content"] for c in chunks)


def test_plain_lines_become_messages_and_blank_lines_nothing(processor):
    assert processor.feed("Hello there").message == "Hello there"
    step = processor.feed("   ")
    assert step.message is None and step.output == ""


def test_triple_quotes_collect_a_multi_line_message(processor):
    assert processor.feed('"""').message is None
    assert processor.continuing
    processor.feed("first line")
    step = processor.feed('second line"""')
    assert step.message == "first line\nsecond line" and not processor.continuing
    assert processor.feed('"""one line"""').message == "one line"
    processor.feed('"""abandoned')
    processor.reset_input()  # Ctrl-C at the `... ` prompt
    assert not processor.continuing and processor.feed("next").message == "next"


def test_set_commands_change_the_session(processor):
    session = processor.session
    assert processor.feed("/set parameter temperature 0").output == \
        "Set parameter 'temperature' to '0'\n"
    processor.feed("/set parameter stop <a> <b>")
    assert session.options == {"temperature": 0.0, "stop": ["<a>", "<b>"]}
    assert processor.feed("/set parameter top_k lots").output.startswith(
        "Couldn't set parameter:")
    assert processor.feed("/set parameter bogus 1").output.startswith("Couldn't set parameter:")
    assert "Available Parameters" in processor.feed("/set parameter").output
    assert processor.feed("/set system Be  brief.").output == "Set system message.\n"
    assert session.system == "Be  brief."
    processor.feed('/set system """You are')
    assert processor.continuing
    assert processor.feed('a pirate."""').output == "Set system message.\n"
    assert session.system == "You are\na pirate."
    processor.feed("/set format json")
    assert session.format == "json"
    assert processor.feed("/set format yaml").output.startswith("Invalid or missing format")
    processor.feed("/set noformat")
    processor.feed("/set verbose")
    processor.feed("/set nowordwrap")
    processor.feed("/set nohistory")
    assert (session.format, session.verbose, session.wordwrap, session.history) == \
        (None, True, False, False)
    processor.feed("/set quiet")
    assert session.verbose is False
    assert processor.feed("/set colour").output == \
        "Unknown command '/set colour'. Type /? for help\n"
    req = session.chat_request()
    assert req["messages"][0] == {"role": "system", "content": "You are\na pirate."}
    assert req["options"] == {"temperature": 0.0, "stop": ["<a>", "<b>"]}


def test_help_unknown_clear_and_bye(processor):
    assert processor.feed("/?").output.startswith("Available Commands:\n  /set")
    assert "/show info" in processor.feed("/help show").output
    assert "Ctrl + d" in processor.feed("/? shortcuts").output
    assert "/set history" in processor.feed("/? set").output
    assert processor.feed("/frobnicate now").output == \
        "Unknown command '/frobnicate'. Type /? for help\n"
    processor.session.messages = [{"role": "user", "content": "x"}]
    assert processor.feed("/clear").output == "Cleared session context\n"
    assert processor.session.messages == []
    assert processor.feed("/bye").exit and processor.feed("/exit").exit


def test_show_reads_the_model_and_the_session(processor, store):
    assert "architecture        llama" in processor.feed("/show info").output
    assert processor.feed("/show license").output == "No license was specified for this model.\n"
    assert processor.feed("/show system").output == \
        "No system message was specified for this model.\n"
    assert processor.feed("/show modelfile").output.startswith("FROM tiny")
    processor.feed("/set parameter num_predict 7")
    shown = processor.feed("/show parameters").output
    assert "No additional parameters" in shown and "num_predict" in shown and "7" in shown
    assert "Available Commands" in processor.feed("/show").output


def test_load_switches_models_and_save_creates_one(processor, client):
    assert processor.feed("/load nothere").output == "Couldn't find model 'nothere'\n"
    assert processor.session.model == "tiny"
    processor.session.messages = [{"role": "user", "content": "hello"},
                                  {"role": "assistant", "content": "hi there"}]
    processor.feed("/set parameter temperature 0")
    processor.feed("/set system Be kind.")
    assert processor.feed("/save tiny-session").output == "Created new model 'tiny-session'\n"
    assert processor.feed("/save bad..name").output.startswith("error:")
    step = processor.feed("/load tiny-session")
    assert step.preload and step.output == "Loading model 'tiny-session'\n"
    assert processor.session.model == "tiny-session" and processor.session.messages == []

    shown = CliRunner().invoke(main, ["show", "tiny-session", "--modelfile"],
                               env={"EXL3_MODELS": str(client.store.root)})
    assert shown.exit_code == 0, shown.output
    saved = parse_modelfile(shown.stdout)
    assert saved.parameters == {"temperature": 0}
    assert saved.system == "Be kind."
    assert saved.messages == [{"role": "user", "content": "hello"},
                              {"role": "assistant", "content": "hi there"}]


def run_repl(client, keys: str, tmp_path, **options):
    out, err = io.StringIO(), io.StringIO()
    with create_pipe_input() as pipe:
        pipe.send_text(keys)
        repl = Repl(client, ReplOptions(model="tiny", **options), stdout=out, stderr=err,
                    pt_input=pipe, pt_output=DummyOutput(),
                    history_file=tmp_path / "history")
        repl.run()
    return repl, out.getvalue(), err.getvalue()


def test_repl_chats_through_prompt_toolkit_and_keeps_history(client, tmp_path):
    keys = ("/set parameter temperature 0\r/set parameter num_predict 5\r"
            "/set verbose\rhello\r\"\"\"\rline one\rline two\"\"\"\r"
            "/set nohistory\rsecret question\r\x03/bye\r")
    repl, out, err = run_repl(client, keys, tmp_path)
    messages = repl.session.messages
    assert [m["role"] for m in messages] == ["user", "assistant"] * 3
    assert messages[2]["content"] == "line one\nline two"
    options = {"temperature": 0.0, "num_predict": 5}
    assert messages[1]["content"] == answer_of(client, messages[:1], options)
    assert messages[3]["content"] == answer_of(client, messages[:3], options)
    assert messages[1]["content"] in out and "Set 'verbose' mode." in out
    assert "Use Ctrl + d or /bye to exit." in out
    # stats after every answer in verbose mode
    assert [line.startswith("eval rate:") for line in err.splitlines()].count(True) == 3
    history = (tmp_path / "history").read_text()
    assert "+hello" in history and "+line two\"\"\"" in history
    assert "secret question" not in history


def test_ctrl_d_on_an_empty_line_exits(client, tmp_path):
    repl, out, _ = run_repl(client, "\x04", tmp_path)
    assert repl.session.messages == [] and out == "\n"


def test_ctrl_c_stops_an_answer_but_keeps_the_session(client, store):
    options = {"temperature": 0, "num_predict": 400}
    final = list(client.chat({"model": "tiny", "messages": [{"role": "user", "content": "Hello"}],
                              "options": options}))[-1]
    assert final["done_reason"] == "length"  # this answer would run on for a while
    env = {**os.environ, "EXL3_MODELS": str(store.root)}
    child = pexpect.spawn(sys.executable, ["-m", "exl3cli", "run", "tiny"], env=env,
                          encoding="utf-8", timeout=60, dimensions=(24, 100))
    try:
        child.expect_exact(">>> ")
        child.sendline("/set parameter temperature 0")
        child.expect_exact("Set parameter 'temperature' to '0'")
        child.sendline("/set parameter num_predict 3000")
        child.expect_exact("Set parameter 'num_predict' to '3000'")
        child.sendline("Hello")
        child.expect_exact("Hello")
        # Well inside the answer, after prompt_toolkit gave the terminal back (before
        # that, Ctrl-C is just a key for the line editor, not SIGINT).
        time.sleep(2)
        interrupted = time.monotonic()
        child.sendintr()
        child.expect_exact(">>> ", timeout=30)
        assert time.monotonic() - interrupted < 4  # 3000 tokens take far longer
        assert "Use Ctrl + d" not in child.before  # it stopped the answer, not a prompt
        time.sleep(0.3)
        child.sendline("/show parameters")
        child.expect_exact("num_predict")
        child.expect_exact(">>> ")
        time.sleep(0.3)
        child.sendeof()
        child.expect(pexpect.EOF)
    finally:
        child.close()
    assert child.exitstatus == 0


class _StoppedClient:
    """Answers "partial" and is then interrupted (Ctrl-C) mid-answer."""

    def chat(self, req):
        yield {"message": {"role": "assistant", "content": "partial"}, "done": False}
        raise KeyboardInterrupt


def test_an_interrupted_answer_stays_in_the_chat_but_not_in_save(tmp_path):
    repl = Repl(_StoppedClient(), ReplOptions(model="tiny"), stdout=io.StringIO(),
                stderr=io.StringIO(), history_file=tmp_path / "history")
    repl.session.messages = [{"role": "user", "content": "hello"},
                             {"role": "assistant", "content": "hi there"}]
    repl.answer("tell me a long story")
    assert repl.session.messages[-1] == {"role": "assistant", "content": "partial"}
    saved = parse_modelfile(repl.session.modelfile_text())
    assert saved.messages == [{"role": "user", "content": "hello"},
                              {"role": "assistant", "content": "hi there"}]
