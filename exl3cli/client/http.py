"""The client interface over HTTP, for when `exl3 serve` runs: the same dicts as
`LocalClient`, sent to and read from the daemon's Ollama routes.

Only the standard library (urllib), so commands stay quick to start. Errors come back
as the same `Exl3Error` subclasses the in-process client raises, so the CLI prints
the same message either way.
"""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

from exl3cli.client.base import Body
from exl3cli.errors import Exl3Error, ModelNotFound, ServerBusy
from exl3cli.store.store_lock import LOCAL_TOKEN_HEADER

PROBE_TIMEOUT = 0.3


def _local_token() -> str:
    """The store's local token (exl3cli/store/store.py), or "" when unreadable."""
    try:
        from exl3cli.store.store import ModelStore

        return ModelStore().local_token()
    except (OSError, Exl3Error):
        return ""


def _error_for(status: int, message: str) -> Exl3Error:
    if status == 404:
        return ModelNotFound(message)
    if status == 503:
        return ServerBusy(message)
    error = Exl3Error(message)
    error.http_status = status
    return error


def _message_of(raw: bytes, fallback: str) -> str:
    try:
        body = json.loads(raw)
    except ValueError:
        return raw.decode("utf-8", "replace").strip() or fallback
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict):
        error = error.get("message")
    return str(error) if error else fallback


class HttpClient:
    """Implements `exl3cli.client.base.Client` against a daemon at `base_url`."""

    def __init__(self, base_url: str, api_key: str | None = None, timeout: float = 600.0):
        self.base_url = base_url.rstrip("/")
        self.api_key = api_key if api_key is not None else os.environ.get("EXL3_API_KEY")
        # A daemon with EXL3_ADMIN_KEY wants it for pull/create/cp/rm: the CLI sends it
        # when its environment has it.
        self.admin_key = os.environ.get("EXL3_ADMIN_KEY") or None
        self.timeout = timeout

    # -- transport --------------------------------------------------------------------
    def _open(self, method: str, path: str, body: Body | None = None,
              headers: dict[str, str] | None = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.base_url + path, data=data, method=method,
                                         headers={k: v for k, v in (headers or {}).items() if v})
        request.add_header("Accept", "application/json")
        if data is not None:
            request.add_header("Content-Type", "application/json")
        if self.api_key:
            request.add_header("Authorization", f"Bearer {self.api_key}")
        if self.admin_key:
            request.add_header("x-admin-key", self.admin_key)
        try:
            return urllib.request.urlopen(request, timeout=self.timeout)
        except urllib.error.HTTPError as error:
            raw = error.read()
            error.close()
            raise _error_for(error.code, _message_of(raw, f"HTTP {error.code}")) from None
        except urllib.error.URLError as error:
            raise Exl3Error(f"could not reach the exl3 daemon at {self.base_url} "
                            f"({error.reason})") from None

    def _call(self, method: str, path: str, body: Body | None = None) -> Body:
        with self._open(method, path, body) as response:
            raw = response.read()
        return json.loads(raw) if raw.strip() else {}

    def _stream(self, path: str, body: Body,
                headers: dict[str, str] | None = None) -> Iterator[Body]:
        """POST with stream: true; the request is sent (and errors raised) now, the
        NDJSON lines are read as the iterator is consumed. Closing it early closes
        the connection, which makes the daemon cancel the job."""
        response = self._open("POST", path, dict(body, stream=body.get("stream", True)),
                              headers)
        return self._lines(response)

    @staticmethod
    def _lines(response: Any) -> Iterator[Body]:
        with response:
            for line in response:
                if not line.strip():
                    continue
                item = json.loads(line)
                if isinstance(item, dict) and "error" in item:
                    raise Exl3Error(_message_of(line, "request failed"))
                yield item

    # -- the Client interface ---------------------------------------------------------
    def list(self) -> Body:
        return self._call("GET", "/api/tags")

    def show(self, req: Body) -> Body:
        return self._call("POST", "/api/show", req)

    def copy(self, req: Body) -> Body:
        return self._call("POST", "/api/copy", req)

    def delete(self, req: Body) -> Body:
        return self._call("DELETE", "/api/delete", req)

    def create(self, req: Body) -> Iterator[Body]:
        # Relative FROM paths are relative to where the command runs, not the daemon.
        # The daemon reads paths only for a client that shows the store's local token
        # (this user on this machine, same store); otherwise the FROM folder or GGUF
        # file is uploaded (/api/blobs) and named in `files`, as Ollama's CLI does.
        body = {"base_dir": os.getcwd(), **req}
        try:
            return self._stream("/api/create", body,
                                headers={LOCAL_TOKEN_HEADER: _local_token()})
        except Exl3Error as error:
            if "not read for HTTP clients" not in str(error):
                raise
        body = self._upload_adapter(body)
        files = self._upload_from(body)
        if files is None:
            if body.get("adapters"):  # FROM is a name: only the adapter was a path
                return self._stream("/api/create", body)
            raise Exl3Error("the daemon does not read paths for this client, and FROM "
                            "is not a local folder or GGUF file to upload")
        return self._stream("/api/create", dict(body, files=files))

    def _upload_adapter(self, body: Body) -> Body:
        """An ADAPTER path's files uploaded and named in `adapters` (the line dropped
        from the Modelfile), as Ollama's CLI does; `body` unchanged without one."""
        from dataclasses import replace
        from pathlib import Path

        from exl3cli.runtime.library import from_path
        from exl3cli.store.modelfile import parse_modelfile

        text = body.get("modelfile")
        modelfile = parse_modelfile(text) if isinstance(text, str) else None
        if modelfile is None or not modelfile.adapter:
            return body
        path = from_path(modelfile.adapter, Path(body["base_dir"]))
        if path is None or not path.exists():
            return body
        names = (["adapter_config.json", "adapter_model.safetensors"] if path.is_dir()
                 else [path.name])
        files = {name: (path / name if path.is_dir() else path) for name in names}
        adapters = {name: self.upload_blob(file) for name, file in files.items()
                    if Path(file).is_file()}
        return dict(body, modelfile=replace(modelfile, adapter=None).to_text(),
                    adapters=adapters)

    def _upload_from(self, body: Body) -> dict[str, str] | None:
        """Upload the files of the Modelfile's FROM path; {name: digest}, or None."""
        from pathlib import Path

        from exl3cli.runtime.library import from_path
        from exl3cli.store.modelfile import parse_modelfile

        text = body.get("modelfile")
        if not isinstance(text, str):
            return None
        path = from_path(parse_modelfile(text).from_, Path(body["base_dir"]))
        if path is None or not path.exists():
            return None
        if path.is_file():
            paths = {path.name: path}
        else:
            paths = {p.relative_to(path).as_posix(): p for p in sorted(path.rglob("*"))
                     if p.is_file() and not any(part.startswith(".")
                                                for part in p.relative_to(path).parts)}
        return {name: self.upload_blob(file) for name, file in paths.items()}

    def upload_blob(self, path: Any) -> str:
        """POST /api/blobs/<digest> with the file's bytes unless the daemon has them."""
        import hashlib

        hasher = hashlib.sha256()
        with open(path, "rb") as handle:
            while chunk := handle.read(1 << 20):
                hasher.update(chunk)
        digest = f"sha256:{hasher.hexdigest()}"
        try:
            self._open("HEAD", f"/api/blobs/{digest}").close()
            return digest
        except ModelNotFound:
            pass
        size = os.path.getsize(path)
        with open(path, "rb") as handle:
            request = urllib.request.Request(
                f"{self.base_url}/api/blobs/{digest}", data=handle, method="POST",
                headers={"Content-Length": str(size), "Content-Type": "application/octet-stream",
                         **({"Authorization": f"Bearer {self.api_key}"} if self.api_key else {})})
            try:
                urllib.request.urlopen(request, timeout=self.timeout).close()
            except urllib.error.HTTPError as error:
                raw = error.read()
                error.close()
                raise _error_for(error.code, _message_of(raw, f"HTTP {error.code}")) from None
        return digest

    def pull(self, req: Body) -> Iterator[Body]:
        return self._stream("/api/pull", req)

    def ps(self) -> Body:
        return self._call("GET", "/api/ps")

    def generate(self, req: Body) -> Iterator[Body]:
        return self._stream("/api/generate", req)

    def chat(self, req: Body) -> Iterator[Body]:
        return self._stream("/api/chat", req)

    def embed(self, req: Body) -> Body:
        """/api/embed: {model, input} -> {embeddings, ...} (InferenceRunner.embed)."""
        return self._call("POST", "/api/embed", req)


def daemon_url(timeout: float = PROBE_TIMEOUT) -> str | None:
    """The URL of an exl3 daemon answering at EXL3_HOST, or None (a quick GET /)."""
    from exl3cli.hostaddr import parse_host

    try:
        url = parse_host().client_url
    except Exl3Error:
        return None
    try:
        with urllib.request.urlopen(url + "/", timeout=timeout) as response:
            answer = response.read(64)
    except (OSError, ValueError):
        return None
    return url if answer.startswith(b"exl3 is running") else None
