"""The tensor-parallel process group: collectives for the layers, messages for the ranks.

Two torch.distributed process groups over one TCP store, built directly (no global
default group, so a process can load, fail and load again):
- data: the layers' all-reduces and all-gathers and the step's input broadcasts; NCCL
  between GPUs, gloo on CPU. Its timeout (``EXL3_TP_TIMEOUT`` seconds, default 300) is
  how long a collective may wait for a rank that stopped answering.
- control (always gloo, on the host): rank 0's messages to the other ranks (what to
  load, each step's plan) and their replies. Ranks wait here between requests, so its
  timeout is unbounded; a rank that dies closes its sockets, which ends every wait.

``EXL3_TP_PROFILE=1`` synchronises the device around each data collective and adds up
the time spent in them (``collective_seconds``: what bench/gpu_tp.sh reports as the
all-reduce share of a step).

Public API:
- ``TensorParallelGroup(store, rank, world, backend, device, timeout=None)``:
  ``all_reduce``, ``all_gather``, ``broadcast`` (layers/parallel.Collective and more),
  ``send(message)`` (rank 0) / ``receive()`` (the others): one picklable object to every
  rank; ``gather_replies(reply) -> list`` (rank 0 gets every rank's reply); ``abort()``.
- ``data_timeout() -> timedelta``.
"""

from __future__ import annotations

import os
import pickle
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

DEFAULT_TIMEOUT_S = 300.0
_REPLY_BYTES = 8192  # one rank's reply (a status line) fits


def data_timeout() -> timedelta:
    raw = os.environ.get("EXL3_TP_TIMEOUT", "")
    try:
        seconds = float(raw) if raw else DEFAULT_TIMEOUT_S
    except ValueError:
        seconds = DEFAULT_TIMEOUT_S
    return timedelta(seconds=max(1.0, seconds))


class TensorParallelGroup:
    """One rank's view of the group (module docstring)."""

    def __init__(self, store: Any, rank: int, world: int, backend: str,
                 device: torch.device | str, timeout: timedelta | None = None):
        self.rank, self.world = rank, world
        self.backend = backend
        self.device = torch.device(device)
        timeout = timeout or data_timeout()
        self._control = dist.ProcessGroupGloo(dist.PrefixStore("control", store), rank, world,
                                              timedelta(days=3650))
        if backend == "nccl":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            self._data = dist.ProcessGroupNCCL(dist.PrefixStore("data", store), rank, world,
                                               options)
        elif backend == "gloo":
            self._data = dist.ProcessGroupGloo(dist.PrefixStore("data", store), rank, world,
                                               timeout)
        else:
            raise ValueError(f"unknown tensor-parallel backend {backend!r}")
        self.profile = os.environ.get("EXL3_TP_PROFILE", "") == "1"
        self.collective_seconds = 0.0
        self.collectives = 0

    # ---- data: what the layers call ---------------------------------------------------

    def _timed(self, work: Any) -> None:
        if not self.profile:
            work.wait()
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        start = time.perf_counter()
        work.wait()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.collective_seconds += time.perf_counter() - start
        self.collectives += 1

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.world > 1:
            if self.profile and self.device.type == "cuda":
                torch.cuda.synchronize(self.device)  # the layer's own work is not counted
            self._timed(self._data.allreduce([tensor]))
        return tensor

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        if self.world == 1:
            return [tensor]
        out = [torch.empty_like(tensor) for _ in range(self.world)]
        self._timed(self._data.allgather([out], [tensor]))
        return out

    def broadcast(self, tensor: torch.Tensor, root: int = 0) -> torch.Tensor:
        """`tensor` from rank `root` into every rank's `tensor` (same shape and dtype)."""
        if self.world > 1:
            self._data.broadcast(tensor, root).wait()
        return tensor

    # ---- control: rank 0's messages -----------------------------------------------------

    def send(self, message: Any) -> None:
        """Rank 0: one object to every other rank (`receive` there)."""
        payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        size = torch.tensor([len(payload)], dtype=torch.long)
        self._control.broadcast(size, 0).wait()
        data = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        self._control.broadcast(data, 0).wait()

    def receive(self) -> Any:
        """The other ranks: rank 0's next `send` (waits as long as it takes)."""
        size = torch.zeros(1, dtype=torch.long)
        self._control.broadcast(size, 0).wait()
        data = torch.empty(int(size.item()), dtype=torch.uint8)
        self._control.broadcast(data, 0).wait()
        return pickle.loads(data.numpy().tobytes())

    def gather_replies(self, reply: Any) -> list[Any]:
        """Every rank's `reply` (a short picklable object), in rank order, on every rank."""
        payload = pickle.dumps(reply)[: _REPLY_BYTES - 8]
        buffer = torch.zeros(_REPLY_BYTES, dtype=torch.uint8)
        buffer[:8] = torch.tensor([len(payload)], dtype=torch.long).view(torch.uint8)
        buffer[8 : 8 + len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        out = [torch.empty_like(buffer) for _ in range(self.world)]
        self._control.allgather([out], [buffer]).wait()
        replies = []
        for item in out:
            length = int(item[:8].view(torch.long).item())
            replies.append(pickle.loads(item[8 : 8 + length].numpy().tobytes()))
        return replies

    def abort(self) -> None:
        """Stop both groups: collectives blocked in them end with an error."""
        for group in (self._data, self._control):
            try:
                group.abort()
            except Exception:  # noqa: BLE001 - best effort while a rank is gone
                pass
