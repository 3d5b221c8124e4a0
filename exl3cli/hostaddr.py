"""EXL3_HOST: where `serve` listens and where the CLI looks for a daemon."""

from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass
from urllib.parse import urlsplit

from exl3cli.errors import Exl3Error

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 11435


@dataclass(frozen=True)
class HostAddress:
    """A parsed `host`, `host:port` or `http://host:port` value."""

    scheme: str
    host: str
    port: int

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.scheme}://{host}:{self.port}"

    @property
    def client_url(self) -> str:
        """The URL a client on this machine uses (a wildcard bind answers on loopback)."""
        if self.host in ("0.0.0.0", "::", ""):
            return f"{self.scheme}://127.0.0.1:{self.port}"
        return self.url

    @property
    def is_loopback(self) -> bool:
        return is_loopback_name(self.host)


def parse_host(text: str | None = None) -> HostAddress:
    """Parse EXL3_HOST (or `text`); missing parts take the defaults 127.0.0.1:11435."""
    if text is None:
        text = os.environ.get("EXL3_HOST", "")
    text = text.strip()
    if not text:
        return HostAddress("http", DEFAULT_HOST, DEFAULT_PORT)
    scheme = "http"
    if "://" in text:
        scheme, _, rest = text.partition("://")
        scheme = scheme.lower()
        if scheme not in ("http", "https"):
            raise Exl3Error(f"EXL3_HOST: unsupported scheme {scheme!r} (use http)")
    else:
        rest = text
    try:
        parts = urlsplit(f"//{rest.rstrip('/')}")
        host = parts.hostname or DEFAULT_HOST
        port = parts.port
    except ValueError as error:
        raise Exl3Error(f"EXL3_HOST: invalid address {text!r} ({error})") from None
    return HostAddress(scheme, host, DEFAULT_PORT if port is None else port)


def is_loopback_name(host: str) -> bool:
    """True for loopback addresses and names (localhost, *.localhost)."""
    host = host.strip("[]").lower().rstrip(".")
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
