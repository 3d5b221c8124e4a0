"""Clients: one interface (`base.Client`), chosen in one place (`get_client`)."""

from __future__ import annotations

from exl3cli.client.base import Client


def get_client() -> Client:
    """The client every command uses: the daemon at EXL3_HOST when one answers, else in-process."""
    from exl3cli.client.http import HttpClient, daemon_url

    url = daemon_url()
    if url:
        return HttpClient(url)
    from exl3cli.client.local import LocalClient

    return LocalClient()


__all__ = ["Client", "get_client"]
