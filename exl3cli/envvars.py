"""EXL3_* on/off switches from the environment, read one way: "1", "on", "true", "yes"
or "0", "off", "false", "no" (any case); unset or empty is the default; anything else
is refused (errors.InvalidSetting), never read as on or off."""

from __future__ import annotations

import os

from exl3cli.errors import InvalidSetting

TRUE = ("1", "on", "true", "yes")
FALSE = ("0", "off", "false", "no")


def parse_switch(name: str, text: str) -> bool:
    """`text`, the value of the switch `name`, as a bool."""
    value = text.strip().lower()
    if value in TRUE:
        return True
    if value in FALSE:
        return False
    raise InvalidSetting(f"{name} must be 1 or 0, got {text.strip()!r}")


def switch(name: str, default: bool) -> bool:
    """The switch `name` from the environment; `default` when unset or empty."""
    text = os.environ.get(name, "")
    return default if not text.strip() else parse_switch(name, text)
