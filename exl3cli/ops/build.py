"""Build C++/CUDA sources as a torch extension once, on first use, and remember why not.

cuda_kernels.py (CUDA GEMM/decode), cuda_viterbi.py and cpu_kernels.py each own one
`LazyExtension`; this module holds what they share: ``openmp_flags()`` (``-fopenmp``
where torch's backend is OpenMP and the compiler has it), the JIT build into a cache folder
keyed by a hash of the sources and the build settings, the try-once, thread-safe,
say-why-once loading that falls back to the PyTorch reference paths, and the one
reading of `EXL3_NO_EXT` (`extensions_disabled`): set to anything but "" or "0", every
extension reports itself unavailable with the reason `NO_EXT_REASON`, read on every
call, so setting it later (even after a build) still takes effect, and unsetting it
lets the extension build then.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from functools import cache
from pathlib import Path
from types import ModuleType

_REGISTRY: list[LazyExtension] = []

NO_EXT_REASON = "EXL3_NO_EXT is set"

# The modules that own an extension; importing them registers it (see all_extensions).
# The C++/CUDA sources, beside the package in the checkout (an editable install).
CSRC = Path(__file__).resolve().parents[2] / "csrc"

EXTENSION_MODULES = ("exl3cli.ops.cpu_kernels", "exl3cli.ops.cuda_kernels", "exl3cli.ops.cuda_viterbi")


def all_extensions() -> list[LazyExtension]:
    """Every compiled extension of the package, in a fixed order (CPU first)."""
    import importlib

    for module in EXTENSION_MODULES:
        importlib.import_module(module)

    def place(extension: LazyExtension) -> int:  # the order of EXTENSION_MODULES, not imports
        owner = getattr(extension._build, "__module__", None)
        return EXTENSION_MODULES.index(owner) if owner in EXTENSION_MODULES else len(
            EXTENSION_MODULES)

    return sorted(_REGISTRY, key=place)


def extensions_disabled() -> bool:
    """Whether `EXL3_NO_EXT` turns every compiled extension off (the pure-PyTorch paths)."""
    return os.environ.get("EXL3_NO_EXT", "") not in ("", "0")


def kernel_cache_root() -> Path:
    """Where built extensions live (`EXL3_KERNEL_CACHE`, default ~/.cache/exl3/kernels)."""
    return Path(os.environ.get("EXL3_KERNEL_CACHE", Path.home() / ".cache/exl3/kernels"))


def openmp_flags() -> list[str]:
    """``-fopenmp`` where torch's parallel backend is OpenMP (Linux wheels): ATen's
    ``at::parallel_for`` is an inline template that only splits work when the code
    including it is compiled with OpenMP (``_OPENMP``); without the flag every loop of a
    C++ extension ran on one thread whatever ``torch.set_num_threads`` said. Only the
    compile flag: the ``GOMP_*`` symbols resolve to the libgomp that libtorch_cpu already
    loaded (one OpenMP runtime, one thread pool, torch's thread count)."""
    import torch

    if sys.platform != "linux" or not torch.backends.openmp.is_available():
        return []
    return ["-fopenmp"] if _compiler_has_openmp() else []


@cache
def _compiler_has_openmp() -> bool:
    """Whether the compiler takes ``-fopenmp`` and finds ``omp.h`` (a preprocessor run):
    without them the kernels still build, on one thread."""
    compiler = os.environ.get("CXX", "c++")
    try:
        done = subprocess.run([compiler, "-fopenmp", "-x", "c++", "-E", "-o", os.devnull, "-"],
                              input=b"#include <omp.h>\n", capture_output=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return False
    return done.returncode == 0


def build_extension(prefix: str, sources: Sequence[Path], key: str, *,
                    hashed: Sequence[Path] = (), cflags: Sequence[str] = ("-O3",),
                    cuda_cflags: Sequence[str] | None = None) -> ModuleType:
    """JIT-build `sources` (plus `hashed` headers in the key) under a name that changes
    whenever a source, `key` (torch/CUDA versions, flags, CPU) or a flag changes, and
    with the sources' folder: torch writes absolute source paths into the build folder's
    build.ninja, so two checkouts sharing one folder would rebuild each other's kernels."""

    digest = hashlib.sha256()
    for path in [*sources, *hashed]:
        digest.update(str(path.resolve()).encode() + path.read_bytes())
    digest.update(f"{key}|{list(cflags)}|{list(cuda_cflags or [])}".encode())
    name = f"{prefix}_{digest.hexdigest()[:16]}"
    build_dir = kernel_cache_root() / name
    build_dir.mkdir(parents=True, exist_ok=True)
    with build_guard(build_dir):
        return _load(prefix, name, sources, build_dir, cflags, cuda_cflags)


def _load(prefix: str, name: str, sources: Sequence[Path], build_dir: Path,
          cflags: Sequence[str], cuda_cflags: Sequence[str] | None) -> ModuleType:
    from torch.utils import cpp_extension

    os.environ.setdefault("MAX_JOBS", str(max(1, min(8, os.cpu_count() or 1))))
    extra = {"extra_cuda_cflags": list(cuda_cflags)} if cuda_cflags is not None else {}
    first_build = not any(build_dir.glob("*.so")) and not any(build_dir.glob("*.pyd"))
    if first_build:
        # Compiling takes minutes and prints nothing: say so once, with an estimate.
        print(f"exl3: compiling kernels for this machine ({prefix}; "
              "first use only, usually 1-3 minutes; later runs load them at once)...",
              file=sys.stderr, flush=True)
    started = time.monotonic()
    module = cpp_extension.load(
        name=name,
        sources=[str(p) for p in sources],
        extra_cflags=list(cflags),
        build_directory=str(build_dir),
        verbose=os.environ.get("EXL3_EXT_VERBOSE", "") not in ("", "0"),
        **extra,
    )
    if first_build:
        print(f"exl3: kernels ready ({time.monotonic() - started:.0f} s)", file=sys.stderr,
              flush=True)
    return module


# torch's build lock is a file that a killed build never removes: every later build
# would wait on it forever. Builds of one folder therefore take an flock of our own
# first (the kernel drops it when its holder dies, however it dies): whoever holds it
# is the only process of ours in torch's build, so a torch lock found then was left by
# a killed build and goes. Where flock does not exist, the owner's pid is written
# beside the lock instead, and a lock whose owner is gone, or older than any build
# takes, is removed.
OWNER_FILE = "exl3-build-owner"
GUARD_FILE = "exl3-build.lock"
STALE_LOCK_SECONDS = 30 * 60


@contextlib.contextmanager
def build_guard(build_dir: Path) -> Iterator[None]:
    """Hold the build of `build_dir` (blocking until no other live process does); torch's
    lock file, if a killed build left one, is removed on entry."""
    try:
        import fcntl
    except ImportError:  # no flock (Windows): the pid-based check
        clear_stale_lock(build_dir)
        (build_dir / OWNER_FILE).write_text(str(os.getpid()))
        yield
        return
    with open(build_dir / GUARD_FILE, "a") as guard:
        fcntl.flock(guard, fcntl.LOCK_EX)
        try:
            if (build_dir / "lock").exists():
                (build_dir / "lock").unlink(missing_ok=True)
                print(f"exl3: removed a stale kernel build lock in {build_dir} "
                      "(a build was killed)", file=sys.stderr)
            (build_dir / OWNER_FILE).write_text(str(os.getpid()))
            yield
        finally:
            fcntl.flock(guard, fcntl.LOCK_UN)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def clear_stale_lock(build_dir: Path, max_age: float = STALE_LOCK_SECONDS) -> bool:
    """Remove the build lock in `build_dir` when no live process holds it (a killed
    build left it); True when one was removed."""
    lock = build_dir / "lock"
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return False
    try:
        owner = int((build_dir / OWNER_FILE).read_text().strip())
    except (OSError, ValueError):
        owner = None
    if age < max_age and (owner is None or _alive(owner)):
        return False
    lock.unlink(missing_ok=True)
    print(f"exl3: removed a stale kernel build lock in {build_dir} (a build was killed)",
          file=sys.stderr)
    return True


class LazyExtension:
    """One extension, built at most once per process: `get()` returns the module or
    None, `reason` says why not; a failure is announced on stderr once (when `announce`
    says the user would care), never raised. `EXL3_NO_EXT` (`extensions_disabled`) is
    checked here, before `why_not`, on every call: it is never announced and never
    remembered as a failure."""

    def __init__(self, label: str, why_not: Callable[[], str | None],
                 build: Callable[[], ModuleType], announce: Callable[[str], bool],
                 fallback: str = "using the PyTorch reference path"):
        self._label, self._why_not, self._build = label, why_not, build
        self._announce, self._fallback = announce, fallback
        self._lock = threading.Lock()
        self._tried = False
        self.module: ModuleType | None = None
        self._reason: str | None = None
        _REGISTRY.append(self)

    @property
    def label(self) -> str:
        return self._label

    @property
    def reason(self) -> str | None:
        """Why `get()` gives None (None before the first try and once built)."""
        return NO_EXT_REASON if extensions_disabled() else self._reason

    def available(self) -> bool:
        """Whether the extension can be used (builds it on the first call)."""
        return self.get() is not None

    def unavailable_reason(self) -> str | None:
        """Why the extension is not in use (trying it first), or None when it is."""
        self.get()
        return self.reason

    def get(self) -> ModuleType | None:
        if extensions_disabled():
            return None
        if self._tried:
            return self.module
        with self._lock:
            if not self._tried:
                reason = self._why_not()
                if reason is None:
                    try:
                        self.module = self._build()
                    except Exception as exc:  # compiler errors arrive as many exception types
                        first = str(exc).strip().splitlines()
                        reason = f"build failed: {first[0] if first else type(exc).__name__}"
                self._reason = reason
                self._tried = True
                if reason is not None and self._announce(reason):
                    print(f"exl3: {self._label} unavailable ({reason}); {self._fallback}, "
                          "which is correct but several times slower (`exl3 kernels` says "
                          "what is missing)", file=sys.stderr)
        return self.module
