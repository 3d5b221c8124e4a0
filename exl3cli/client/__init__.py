"""Clients: one interface (`base.Client`), chosen in one place (`get_client`)."""

from __future__ import annotations

from exl3cli.client.base import Client


def get_client() -> Client:
    """The client every command uses. In-process for now; the seam for the daemon client."""
    from exl3cli.client.local import LocalClient

    return LocalClient()


__all__ = ["Client", "get_client"]
