"""The REPL's logic without any terminal I/O: session state, `\"\"\"` multi-line input
and the slash commands. `repl.py` feeds it lines from prompt_toolkit and prints what
it returns, so everything here is testable with plain strings.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from exl3cli.errors import Exl3Error, InvalidModelName, ModelNotFound

HELP = """Available Commands:
  /set            Set session variables
  /show           Show model information
  /load <model>   Load a session or model
  /save <model>   Save your current session
  /clear          Clear session context
  /bye            Exit
  /?, /help       Help for a command
  /? shortcuts    Help for keyboard shortcuts

Use \"\"\" to begin a multi-line message.
"""

HELP_SET = """Available Commands:
  /set parameter ...     Set a parameter
  /set system <string>   Set system message
  /set history           Enable history
  /set nohistory         Disable history
  /set wordwrap          Enable wordwrap
  /set nowordwrap        Disable wordwrap
  /set format json       Enable JSON mode
  /set noformat          Disable formatting
  /set verbose           Show LLM stats
  /set quiet             Disable LLM stats
  /set think             Enable thinking
  /set nothink           Disable thinking
"""

HELP_SHOW = """Available Commands:
  /show info         Show details for this model
  /show license      Show model license
  /show modelfile    Show Modelfile for this model
  /show parameters   Show parameters for this model
  /show system       Show system message
  /show template     Show prompt template
"""

HELP_SHORTCUTS = """Available keyboard shortcuts:
  Ctrl + a            Move to the beginning of the line (Home)
  Ctrl + e            Move to the end of the line (End)
   Alt + b            Move back (left) one word
   Alt + f            Move forward (right) one word
  Ctrl + k            Delete the sentence after the cursor
  Ctrl + u            Delete the sentence before the cursor
  Ctrl + w            Delete the word before the cursor

  Ctrl + l            Clear the screen
  Ctrl + c            Stop the model from responding
  Ctrl + d            Exit exl3 (/bye)
"""

HELP_PARAMETERS = """Available Parameters:
  /set parameter seed <int>             Random number seed
  /set parameter num_predict <int>      Max number of tokens to predict
  /set parameter top_k <int>            Pick from top k num of tokens
  /set parameter top_p <float>          Pick token based on sum of probabilities
  /set parameter min_p <float>          Pick token based on top token probability * min_p
  /set parameter num_ctx <int>          Set the context size
  /set parameter temperature <float>    Set creativity level
  /set parameter repeat_penalty <float> How strongly to penalize repetitions
  /set parameter repeat_last_n <int>    Set how far back to look for repetitions
  /set parameter stop <string> <string> ...   Set the stop parameters
"""

_QUOTES = '"""'


@dataclass
class ReplOptions:
    """How `exl3 run` started the REPL."""

    model: str
    system: str | None = None
    format: str | None = None
    keepalive: str | None = None
    verbose: bool = False
    wordwrap: bool = True
    think: bool | None = None
    hide_thinking: bool = False
    images: tuple[str, ...] = ()  # `run --image` files: sent with the first message


@dataclass
class ReplSession:
    """One conversation: the model, its messages and the /set choices."""

    model: str
    system: str | None = None
    format: str | None = None
    keepalive: str | None = None
    verbose: bool = False
    wordwrap: bool = True
    history: bool = True
    think: bool | None = None
    hide_thinking: bool = False
    options: dict[str, Any] = field(default_factory=dict)
    messages: list[dict[str, str]] = field(default_factory=list)
    # Replies stopped with Ctrl-C: they stay in the conversation (the model sees what it
    # said), but /save leaves them, and the question they answer, out of the Modelfile.
    interrupted: list[dict[str, str]] = field(default_factory=list)
    # Image files to send with the next message (`run --image` in the REPL).
    pending_images: list[str] = field(default_factory=list)

    @classmethod
    def from_options(cls, opts: ReplOptions) -> ReplSession:
        return cls(model=opts.model, system=opts.system, format=opts.format,
                   keepalive=opts.keepalive, verbose=opts.verbose, wordwrap=opts.wordwrap,
                   think=opts.think, hide_thinking=opts.hide_thinking,
                   pending_images=list(opts.images))

    def chat_request(self) -> dict[str, Any]:
        """The /api/chat body for the conversation so far."""
        messages = list(self.messages)
        if self.system:
            messages.insert(0, {"role": "system", "content": self.system})
        req: dict[str, Any] = {"model": self.model, "messages": messages, "stream": True}
        if self.options:
            req["options"] = dict(self.options)
        if self.format:
            req["format"] = self.format
        if self.keepalive is not None:
            req["keep_alive"] = self.keepalive
        if self.think is not None:
            req["think"] = self.think
        return req

    def modelfile_text(self) -> str:
        """A Modelfile that recreates this session on top of the current model."""
        from exl3cli.store.modelfile import Modelfile

        saved: list[dict[str, str]] = []
        for message in self.messages:
            if any(message is stopped for stopped in self.interrupted):
                if saved and saved[-1].get("role") == "user":
                    saved.pop()
                continue
            saved.append(dict(message))
        return Modelfile(from_=self.model, parameters=dict(self.options), system=self.system,
                         messages=saved).to_text()


@dataclass
class ReplStep:
    """What the I/O layer should do after one input line."""

    output: str = ""            # text to print (already ends with a newline if non-empty)
    message: str | None = None  # a user message to send to the model
    exit: bool = False
    preload: bool = False       # the model changed: load it now


class ReplProcessor:
    """Turns input lines into session changes, messages to send, and text to print."""

    def __init__(self, session: ReplSession, client: Any):
        self.session = session
        self.client = client
        self._buffer: list[str] = []
        self._multiline: str | None = None  # None, "prompt" or "system"

    @property
    def continuing(self) -> bool:
        """True while a `\"\"\"` block is open (the prompt shows `... `)."""
        return self._multiline is not None

    def reset_input(self) -> None:
        """Forget a half-typed multi-line block (Ctrl-C at the prompt)."""
        self._buffer = []
        self._multiline = None

    def feed(self, line: str) -> ReplStep:
        if self._multiline is not None:
            return self._continue_block(line)
        if line.startswith(_QUOTES):
            return self._open_block(line[len(_QUOTES):], "prompt")
        if line.startswith("/"):
            return self._command(line)
        if not line.strip():
            return ReplStep()
        return ReplStep(message=line)

    # ---- multi-line ---------------------------------------------------------------

    def _open_block(self, rest: str, kind: str) -> ReplStep:
        if rest.endswith(_QUOTES):
            return self._finish_block(kind, rest[:-len(_QUOTES)])
        self._buffer = [rest] if rest else []  # `"""` alone does not start with a blank line
        self._multiline = kind
        return ReplStep()

    def _continue_block(self, line: str) -> ReplStep:
        if not line.endswith(_QUOTES):
            self._buffer.append(line)
            return ReplStep()
        self._buffer.append(line[:-len(_QUOTES)])
        text = "\n".join(self._buffer)
        kind = self._multiline or "prompt"
        self.reset_input()
        return self._finish_block(kind, text)

    def _finish_block(self, kind: str, text: str) -> ReplStep:
        if kind == "system":
            return self._set_system(text)
        return ReplStep(message=text) if text.strip() else ReplStep()

    # ---- slash commands -----------------------------------------------------------

    def _command(self, line: str) -> ReplStep:
        words = line.split()
        name = words[0]
        if name in ("/bye", "/exit"):
            return ReplStep(exit=True)
        if name in ("/?", "/help"):
            return self._help(words[1:])
        if name == "/set":
            return self._set(line, words[1:])
        if name == "/show":
            return self._show(words[1:])
        if name == "/clear":
            self.session.messages = []
            return ReplStep("Cleared session context\n")
        if name == "/load":
            return self._load(words[1:])
        if name == "/save":
            return self._save(words[1:])
        return ReplStep(f"Unknown command '{name}'. Type /? for help\n")

    def _help(self, args: list[str]) -> ReplStep:
        topic = args[0].lstrip("/") if args else ""
        texts = {"set": HELP_SET, "show": HELP_SHOW, "shortcut": HELP_SHORTCUTS,
                 "shortcuts": HELP_SHORTCUTS}
        return ReplStep(texts.get(topic, HELP) + "\n")

    def _set(self, line: str, args: list[str]) -> ReplStep:
        session = self.session
        if not args:
            return ReplStep(HELP_SET + "\n")
        what = args[0]
        flags = {
            "history": ("history", True, "Set 'history' mode."),
            "nohistory": ("history", False, "Set 'nohistory' mode."),
            "wordwrap": ("wordwrap", True, "Set 'wordwrap' mode."),
            "nowordwrap": ("wordwrap", False, "Set 'nowordwrap' mode."),
            "verbose": ("verbose", True, "Set 'verbose' mode."),
            "quiet": ("verbose", False, "Set 'quiet' mode."),
            "think": ("think", True, "Set 'think' mode."),
            "nothink": ("think", False, "Set 'nothink' mode."),
        }
        if what in flags:
            attribute, value, message = flags[what]
            setattr(session, attribute, value)
            return ReplStep(message + "\n")
        if what == "format":
            if len(args) < 2 or args[1] != "json":
                return ReplStep("Invalid or missing format. For 'json' mode use "
                                "'/set format json'\n")
            session.format = "json"
            return ReplStep("Set format to 'json' mode.\n")
        if what == "noformat":
            session.format = None
            return ReplStep("Disabled format.\n")
        if what == "parameter":
            return self._set_parameter(args[1:])
        if what == "system":
            # Keep the text as typed after "/set system", spaces included.
            text = line.split(None, 2)[2] if len(args) > 1 else ""
            if not text:
                return ReplStep(HELP_SET + "\n")
            if text.startswith(_QUOTES):
                return self._open_block(text[len(_QUOTES):], "system")
            return self._set_system(text)
        return ReplStep(f"Unknown command '/set {what}'. Type /? for help\n")

    def _set_system(self, text: str) -> ReplStep:
        self.session.system = text
        return ReplStep("Set system message.\n")

    def _set_parameter(self, args: list[str]) -> ReplStep:
        from exl3cli.store.modelfile import PARAMETER_TYPES, parse_parameter

        if len(args) < 2:
            return ReplStep(HELP_PARAMETERS + "\n")
        name, values = args[0], args[1:]
        try:
            if PARAMETER_TYPES.get(name) is list:
                value: Any = [parse_parameter(name, v) for v in values]
            else:
                value = parse_parameter(name, " ".join(values))
        except ValueError as error:
            return ReplStep(f"Couldn't set parameter: {error}\n")
        self.session.options[name] = value
        return ReplStep(f"Set parameter '{name}' to '{', '.join(values)}'\n")

    def _show(self, args: list[str]) -> ReplStep:
        if not args:
            return ReplStep(HELP_SHOW + "\n")
        what = args[0]
        if what not in ("info", "license", "modelfile", "parameters", "system", "template"):
            return ReplStep(f"Unknown command '/show {what}'. Type /? for help\n")
        try:
            info = self.client.show({"model": self.session.model})
        except Exl3Error as error:
            return ReplStep(f"error: couldn't get model: {error}\n")
        return ReplStep(render_show(what, info, self.session))

    def _load(self, args: list[str]) -> ReplStep:
        if len(args) != 1:
            return ReplStep("Usage:\n  /load <modelname>\n")
        model = args[0]
        try:
            self.client.show({"model": model})
        except (ModelNotFound, InvalidModelName):
            return ReplStep(f"Couldn't find model '{model}'\n")
        self.session.model = model
        self.session.messages = []
        return ReplStep(f"Loading model '{model}'\n", preload=True)

    def _save(self, args: list[str]) -> ReplStep:
        if len(args) != 1:
            return ReplStep("Usage:\n  /save <modelname>\n")
        name = args[0]
        try:
            for _ in self.client.create({"model": name,
                                         "modelfile": self.session.modelfile_text()}):
                pass
        except InvalidModelName:
            return ReplStep(f"error: The model name '{name}' is invalid\n")
        except Exl3Error as error:
            return ReplStep(f"error: {error}\n")
        return ReplStep(f"Created new model '{name}'\n")


def _format_value(value: Any) -> str:
    if isinstance(value, list):
        return "[" + " ".join(str(v) for v in value) + "]"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def render_show(what: str, info: dict[str, Any], session: ReplSession) -> str:
    """The text of `/show <what>` from an /api/show response and the session."""
    if what == "license":
        license_text = info.get("license") or ""
        return (license_text.rstrip("\n") if license_text
                else "No license was specified for this model.") + "\n"
    if what == "modelfile":
        return (info.get("modelfile") or "").rstrip("\n") + "\n"
    if what == "system":
        system = session.system or info.get("system")
        return f"{system}\n\n" if system else "No system message was specified for this model.\n"
    if what == "template":
        template = info.get("template")
        return f"{template}\n" if template else "No prompt template was specified for this model.\n"
    if what == "parameters":
        lines = ["Model defined parameters:"]
        parameters = (info.get("parameters") or "").strip("\n")
        if parameters:
            lines += [f"  {line}" for line in parameters.splitlines()]
        else:
            lines.append("  No additional parameters were specified for this model.")
        lines.append("")
        if session.options:
            lines.append("User defined parameters:")
            lines += [f"  {name:<30} {_format_value(value)}"
                      for name, value in session.options.items()]
            lines.append("")
        return "\n".join(lines) + "\n"
    return render_info(info)


def render_info(info: dict[str, Any]) -> str:
    """`/show info`: the model's main facts, two-column like `exl3 show`."""
    details = info.get("details") or {}
    model_info = info.get("model_info") or {}
    family = details.get("family") or model_info.get("general.architecture") or ""

    def find(suffix: str) -> Any:
        return next((v for k, v in model_info.items() if k.endswith(suffix)), None)

    rows = [("architecture", family),
            ("parameters", details.get("parameter_size") or ""),
            ("context length", find(".context_length") or ""),
            ("embedding length", find(".embedding_length") or ""),
            ("quantization", details.get("quantization_level") or "")]
    lines = ["  Model"] + [f"    {label:<20}{value}" for label, value in rows if value != ""]
    return "\n".join(lines) + "\n\n"
