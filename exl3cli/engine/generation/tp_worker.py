"""A tensor-parallel rank other than 0: it loads its shard and runs every step rank 0
tells it to, over its own slice of the KV cache.

Rank 0 (tp_driver.TensorParallelModel, which the generator drives like any model)
sends one control message per operation; this loop answers them in order:
- ``load`` {folder, dtype, linear_mode, cpu_weights}: load this rank's shard
  (models/tp_shard.py), then reply "ok" or the error's message;
- ``pool`` {key, num_pages, cache_type}: a page pool for this rank's KV heads, the
  mirror of rank 0's pool ``key`` (same pages, same page size);
- ``forward`` {shape, pool, cache, last}: receive the input ids (and a fixed-shape
  step's buffer) by broadcast, rebuild rank 0's step over the mirror pool (its pages,
  lengths and selected rows: ``PagedBatch.describe`` / ``FixedDecodeStep.describe``),
  run the shard's forward (its all-reduces meet rank 0's); the logits are rank 0's;
- ``hidden`` {shape}: the same without a cache (embeddings);
- ``stop``: return. Any message may carry ``drop``: pools rank 0 no longer has.

A rank that fails leaves its error under ``error/<rank>`` in the group's store and
exits: rank 0 sees it go (tp_launch.RankWatch) and stops the model with that message.
A rank whose parent (rank 0, when exl3 started it) goes away exits too.

Public API: ``serve(group, device, store=None)``, ``worker_entry(...)`` (the
``torch.multiprocessing`` target), ``main()`` (``python -m
exl3cli.engine.generation.tp_worker`` under torchrun).
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import sys
import threading
import traceback
from typing import Any

import torch

from exl3cli.engine.generation.decode_step import FixedDecodeStep
from exl3cli.engine.generation.tp_group import TensorParallelGroup
from exl3cli.engine.kvcache.paged_attention import mirrored_batch
from exl3cli.engine.kvcache.paged_cache import PagePool


def serve(group: TensorParallelGroup, device: torch.device, store: Any = None) -> None:
    """Answer rank 0's messages until `stop` (module docstring)."""
    model: Any = None
    pools: dict[int, PagePool] = {}
    steps: dict[tuple[int, int, int], FixedDecodeStep] = {}
    while True:
        message = group.receive()
        for key in message.get("drop", ()):
            pools.pop(key, None)
            for step_key in [k for k in steps if k[0] == key]:
                del steps[step_key]
        op = message["op"]
        if op == "stop":
            return
        if op == "load":
            model = _load(group, device, message)
        elif op == "pool":
            pools[message["key"]] = PagePool(
                message["num_pages"], len(model.layers), model.config.num_kv_heads,
                model.config.head_dim, model.dtype, device, message["cache_type"])
        elif op in ("forward", "hidden"):
            ids = group.broadcast(torch.empty(message["shape"], dtype=torch.long,
                                              device=device))
            with torch.inference_mode():
                if op == "hidden":
                    model.hidden_states(ids)
                    continue
                cache = _rebuild(group, message, pools, steps)
                model.forward(ids, cache, last_logits_only=message["last"])
        else:
            raise RuntimeError(f"unknown tensor-parallel message {op!r}")


def _load(group: TensorParallelGroup, device: torch.device, message: dict) -> Any:
    from exl3cli.engine.models.tp_shard import load_shard

    model, reply = None, "ok"
    try:
        model = load_shard(message["folder"], group, device, message.get("dtype"),
                           linear_mode=message.get("linear_mode"),
                           cpu_weights=message.get("cpu_weights"))
    except Exception as error:  # reported to rank 0, which refuses the load
        reply = f"{type(error).__name__}: {error}"[:4000]
    group.gather_replies(reply)
    return model


def _rebuild(group: TensorParallelGroup, message: dict, pools: dict[int, PagePool],
             steps: dict[tuple[int, int, int], FixedDecodeStep]) -> Any:
    description = message["cache"]
    if description is None:
        return None
    pool = pools[message["pool"]]
    if description["kind"] == "paged":
        return mirrored_batch(pool, description)
    key = (message["pool"], description["batch"], description["pages"])
    step = steps.get(key)
    if step is None:
        step = steps[key] = FixedDecodeStep(pool, description["batch"], description["pages"])
    group.broadcast(step.buffer)
    return step


def _watch_parent() -> None:
    """Exit when the process that started this rank is gone (no orphans)."""
    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def wait() -> None:
        multiprocessing.connection.wait([parent.sentinel])
        os._exit(3)

    threading.Thread(target=wait, name="exl3-tp-parent", daemon=True).start()


def run_rank(rank: int, world: int, host: str, port: int, backend: str, device: str) -> int:
    """Join the group through the store at host:port and serve; the exit code."""
    import torch.distributed as dist

    store = dist.TCPStore(host, port, world, False)
    try:
        store.set(f"up/{rank}", "1")
        if device.startswith("cuda"):
            torch.cuda.set_device(torch.device(device))
        group = TensorParallelGroup(store, rank, world, backend, device)
        serve(group, torch.device(device), store)
        return 0
    except BaseException as error:  # told to rank 0 through the store, then exit
        text = f"{type(error).__name__}: {error}"
        try:
            store.set(f"error/{rank}", text[:4000])
        except Exception:  # noqa: BLE001 - the store may be gone with rank 0
            pass
        if not isinstance(error, (KeyboardInterrupt, SystemExit)):
            traceback.print_exc(file=sys.stderr)
        return 1


def worker_entry(rank: int, world: int, host: str, port: int, backend: str,
                 device: str) -> None:
    """The process target exl3's launcher starts (tp_launch.py)."""
    _watch_parent()
    os._exit(run_rank(rank, world, host, port, backend, device))


def main() -> None:
    """A rank started by torchrun (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT,
    LOCAL_RANK): the ranks above 0 serve rank 0 (`exl3 serve --tp N` in rank 0)."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", rank))
    cuda = torch.cuda.is_available()
    sys.exit(run_rank(rank, world, os.environ["MASTER_ADDR"],
                      int(os.environ["MASTER_PORT"]) + 1, "nccl" if cuda else "gloo",
                      f"cuda:{local}" if cuda else "cpu"))


if __name__ == "__main__":
    main()
