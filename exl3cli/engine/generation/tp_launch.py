"""Starting a tensor-parallel model: one process per device, rank 0 in this process.

``load_tensor_parallel(folder, world)`` checks that the model splits (before any
process starts), opens a TCP store on a free local port, spawns ranks 1..N-1 with
``torch.multiprocessing`` (spawn: a fresh interpreter each, CUDA-safe), waits for
each to come up (a rank that dies while starting is reported, not waited for), joins
the group, tells every rank to load its shard, loads rank 0's, and returns the
``TensorParallelModel`` the generator drives. Under torchrun (``RANK`` and
``WORLD_SIZE`` set, the other ranks running ``python -m
exl3cli.engine.generation.tp_worker``) nothing is spawned: rank 0 opens the store on
``MASTER_PORT + 1`` and the ranks join it.

Devices: with CUDA, rank r runs on ``cuda:r`` over NCCL (N GPUs needed); otherwise
(or with ``device="cpu"``) every rank runs on the CPU over gloo: the same code, for
tests and for machines without GPUs.

``RankWatch`` waits on the spawned processes: when one exits before it was told to
stop, the model fails with its exit code and the error it left in the store, the
group is aborted (a collective waiting for it ends) and the other ranks are killed:
no process is left behind.

Public API: ``load_tensor_parallel(folder, world, device=None, dtype=None, *,
linear_mode=None, cpu_weights=None, start_timeout=120.0) -> TensorParallelModel``,
``RankWatch``.
"""

from __future__ import annotations

import multiprocessing.connection
import os
import threading
import time
from pathlib import Path
from typing import Any

import torch

from exl3cli.engine.generation.tp_driver import TensorParallelModel
from exl3cli.engine.generation.tp_group import TensorParallelGroup
from exl3cli.errors import InvalidOption, ModelLoadError


class RankWatch:
    """Watches the spawned ranks (module docstring)."""

    def __init__(self, processes: list[Any], store: Any):
        self.processes = processes  # rank r at index r - 1
        self.store = store
        self.failure: str | None = None
        self.model: TensorParallelModel | None = None
        self._stopping = False
        self._thread = threading.Thread(target=self._watch, name="exl3-tp-watch", daemon=True)
        self._thread.start()

    def _error_of(self, rank: int) -> str:
        try:
            if self.store.check([f"error/{rank}"]):
                return ": " + self.store.get(f"error/{rank}").decode(errors="replace")
        except Exception:  # noqa: BLE001 - the store is best effort here
            pass
        return ""

    def dead(self) -> str | None:
        """The first rank that has exited, as a sentence, else None."""
        for rank, process in enumerate(self.processes, start=1):
            if process.exitcode is not None:
                return (f"rank {rank} (pid {process.pid}) exited with code "
                        f"{process.exitcode}{self._error_of(rank)}")
        return None

    def _watch(self) -> None:
        sentinels = [p.sentinel for p in self.processes]
        while sentinels:
            ready = multiprocessing.connection.wait(sentinels)
            if self._stopping:
                return
            if ready:
                time.sleep(0.05)  # let a dying rank's error reach the store
                self.failure = self.dead() or "a tensor-parallel rank exited"
                if self.model is not None:
                    self.model.fail(self.failure)
                self._kill()
                return

    def _kill(self) -> None:
        for process in self.processes:
            if process.exitcode is None:
                process.kill()
        for process in self.processes:
            process.join(timeout=5)

    def expect_exit(self) -> None:
        """The ranks are about to be told to stop: their exits are no failure."""
        self._stopping = True

    def stop(self, grace: float = 10.0) -> None:
        """After the ranks were told to stop: wait for them, kill those that linger."""
        self._stopping = True
        deadline = time.monotonic() + grace
        for process in self.processes:
            process.join(timeout=max(0.0, deadline - time.monotonic()))
        self._kill()


def _backend(device: Any, world: int) -> tuple[str, list[str]]:
    kind = torch.device(device).type if device is not None else (
        "cuda" if torch.cuda.is_available() else "cpu")
    if kind == "cpu":
        return "gloo", ["cpu"] * world
    if kind != "cuda":
        raise InvalidOption(f"tensor parallel runs on CUDA devices or the CPU, not {kind}")
    count = torch.cuda.device_count()
    if count < world:
        raise InvalidOption(f"tensor parallel {world} needs {world} GPUs, {count} visible")
    return "nccl", [f"cuda:{r}" for r in range(world)]


def check_splits(folder: str | Path, world: int) -> None:
    """Refuse a model that cannot be split `world` ways, before any process starts."""
    from exl3cli.engine.layers.fused_experts import split_fused_experts
    from exl3cli.engine.models.shard import plan_shards
    from exl3cli.engine.models.tp_shard import check_parallel_support
    from exl3cli.engine.models.weights import WeightReader
    from exl3cli.engine.spec.architecture import get_architecture, load_family_config

    config = load_family_config(folder)
    spec = get_architecture(config.architecture)
    check_parallel_support(config, spec)
    reader = split_fused_experts(WeightReader(folder), config, spec)
    names = spec.tensor_names(reader.has)
    for rank in range(world):
        plan_shards(config, spec, names, reader, rank, world)


def load_tensor_parallel(folder: str | Path, world: int, device: Any = None,
                         dtype: torch.dtype | None = None, *, linear_mode: str | None = None,
                         cpu_weights: str | None = None,
                         start_timeout: float = 120.0) -> TensorParallelModel:
    """`folder` split over `world` ranks (module docstring)."""
    if world < 2:
        raise InvalidOption(f"tensor parallel needs at least 2 ranks, got {world}")
    check_splits(folder, world)
    backend, devices = _backend(device, world)
    if os.environ.get("WORLD_SIZE") and os.environ.get("RANK") == "0":
        group, watch, store = _join_torchrun(world, backend, devices[0])
    else:
        group, watch, store = _spawn(world, backend, devices, start_timeout)
    try:
        group.send({"op": "load", "folder": str(folder), "dtype": dtype,
                    "linear_mode": linear_mode, "cpu_weights": cpu_weights})
        from exl3cli.engine.models.tp_shard import load_shard

        error = None
        try:
            local = load_shard(folder, group, devices[0], dtype, linear_mode=linear_mode,
                               cpu_weights=cpu_weights)
        except Exception as exc:  # still answer the others' replies, then refuse
            error, local = exc, None
        replies = group.gather_replies("ok" if error is None else str(error))
        failed = [f"rank {r}: {reply}" for r, reply in enumerate(replies) if reply != "ok"]
        if error is not None and isinstance(error, ModelLoadError):
            raise error
        if failed:
            raise ModelLoadError("tensor-parallel load failed: " + "; ".join(failed))
    except BaseException:
        _shut(group, watch)
        raise
    model = TensorParallelModel(local, group, watch)
    if watch is not None:
        watch.model = model
        if watch.failure is not None:
            model.fail(watch.failure)
    return model


def _shut(group: TensorParallelGroup, watch: RankWatch | None) -> None:
    if watch is not None:
        watch.expect_exit()
    try:
        group.send({"op": "stop"})
    except Exception:  # noqa: BLE001 - ranks may be gone already
        pass
    if watch is not None:
        watch.stop(grace=5.0)


def _spawn(world: int, backend: str, devices: list[str],
           start_timeout: float) -> tuple[TensorParallelGroup, RankWatch, Any]:
    import torch.distributed as dist
    import torch.multiprocessing as mp

    from exl3cli.engine.generation.tp_worker import worker_entry

    store = dist.TCPStore("127.0.0.1", 0, world, True, wait_for_workers=False)
    context = mp.get_context("spawn")
    processes = [context.Process(target=worker_entry, daemon=True, name=f"exl3-tp-rank{r}",
                                 args=(r, world, "127.0.0.1", store.port, backend, devices[r]))
                 for r in range(1, world)]
    for process in processes:
        process.start()
    watch = RankWatch(processes, store)
    deadline = time.monotonic() + start_timeout
    for rank in range(1, world):
        while not store.check([f"up/{rank}"]):
            if watch.failure is not None or time.monotonic() > deadline:
                watch.stop(grace=0.0)
                raise ModelLoadError("tensor-parallel rank did not start: "
                                     f"{watch.failure or f'rank {rank} timed out'}")
            time.sleep(0.05)
    return TensorParallelGroup(store, 0, world, backend, devices[0]), watch, store


def _join_torchrun(world: int, backend: str,
                   device: str) -> tuple[TensorParallelGroup, None, Any]:
    import torch.distributed as dist

    if int(os.environ["WORLD_SIZE"]) != world:
        raise InvalidOption(f"tensor parallel {world} under torchrun with WORLD_SIZE "
                            f"{os.environ['WORLD_SIZE']}")
    store = dist.TCPStore(os.environ.get("MASTER_ADDR", "127.0.0.1"),
                          int(os.environ["MASTER_PORT"]) + 1, world, True)
    return TensorParallelGroup(store, 0, world, backend, device), None, store
