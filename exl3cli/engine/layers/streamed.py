"""Streamed layers: trellis weights in pinned host memory, copied to the device per forward.

The other way to run a model larger than the GPU (engine/layers/offload.py runs the
offloaded layers' projections on the CPU instead). Every streamed decoder layer keeps
its norms, scales, biases, attention and KV cache on the device; only its trellis
tensors (all but a few KiB of its bytes) live in pinned host memory. The device holds
two slots, each the size of the largest streamed layer's trellises: streamed layer j
runs from slot j % 2, and while it computes, layer j + 1 is copied into the other
slot on a copy stream. Events order the two streams: a copy waits until the compute
stream has passed the layer that last used its slot, a layer waits for its own copy.
The copy of the first streamed layer starts when the model's first layer starts, so
it overlaps the resident layers. Everything a layer computes is what it computes with
its weights resident: the logits are bit-identical (tests/engine/test_streamed.py).

The copies are ordinary stream work, so a captured CUDA graph (generation/decode_step.py)
records them with their event edges and replays them.

On a CPU device (tests) there are no streams: a slot is filled by a plain copy when its
layer starts, which exercises the slot bookkeeping the GPU path uses.

Public API:
- ``LayerStreamer(device)``: ``add(layer)`` moves one built layer's trellis tensors to
  (pinned) host memory, ``finish(layers)`` allocates the two slots, points each
  streamed layer's tensors into its slot and hooks the layers; ``host_bytes`` /
  ``slot_bytes`` say what it holds where; ``streamed`` the layers' indices.
- ``STREAMED_BUFFERS``: the buffer names that are streamed ("trellis" of an
  ``Exl3Linear``, "trellis_t" of a ``CpuExl3Linear``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

STREAMED_BUFFERS = ("trellis", "trellis_t")
_ALIGN = 256  # bytes: every tensor in a slot starts on a 256-byte boundary


def _aligned(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


class _Streamed:
    """One streamed layer: its (module, buffer name, offset, shape, dtype) entries and
    the host bytes they are copied from."""

    def __init__(self, entries: list[tuple[nn.Module, str, int, torch.Size, torch.dtype]],
                 host: torch.Tensor):
        self.entries = entries
        self.host = host  # uint8 [nbytes], pinned on a CUDA host
        self.copied: Any = None  # torch.cuda.Event of the last copy into the slot


class LayerStreamer:
    """See the module docstring."""

    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)
        self._cuda = self.device.type == "cuda"
        self._layers: list[_Streamed] = []
        self._slots: list[torch.Tensor] = []
        self._copy_stream: Any = (torch.cuda.Stream(device=self.device) if self._cuda
                                  else None)
        self._next = 0  # the streamed layer whose copy is issued next
        self.streamed: list[int] = []

    @property
    def host_bytes(self) -> int:
        return sum(s.host.numel() for s in self._layers)

    @property
    def slot_bytes(self) -> int:
        return sum(s.numel() for s in self._slots)

    def add(self, layer: nn.Module, index: int) -> None:
        """Move `layer`'s streamed tensors to host memory now (the device copies go
        back to the allocator before the next layer is built)."""
        found: list[tuple[nn.Module, str, torch.Tensor]] = []
        for module in layer.modules():
            for name in STREAMED_BUFFERS:
                tensor = module._buffers.get(name)
                if tensor is not None:
                    found.append((module, name, tensor))
        offset, entries = 0, []
        for module, name, tensor in found:
            entries.append((module, name, offset, tensor.shape, tensor.dtype))
            offset += _aligned(tensor.numel() * tensor.element_size())
        host = torch.empty(offset, dtype=torch.uint8, pin_memory=self._cuda)
        for (module, name, start, _, _), (_, _, tensor) in zip(entries, found, strict=True):
            nbytes = tensor.numel() * tensor.element_size()
            host[start:start + nbytes].copy_(tensor.contiguous().view(-1).view(torch.uint8))
            module._buffers[name] = None  # the device copy is released
        self._layers.append(_Streamed(entries, host))
        self.streamed.append(index)

    def finish(self, layers: list[nn.Module]) -> None:
        """Two slots of the largest streamed layer's size; every streamed tensor
        becomes a view into its layer's slot; pre-hooks order the copies."""
        if not self._layers:
            return
        size = max(s.host.numel() for s in self._layers)
        count = min(2, len(self._layers))
        self._slots = [torch.empty(size, dtype=torch.uint8, device=self.device)
                       for _ in range(count)]
        for j, streamed in enumerate(self._layers):
            slot = self._slots[j % count]
            for module, name, offset, shape, dtype in streamed.entries:
                nbytes = shape.numel() * torch.empty((), dtype=dtype).element_size()
                module._buffers[name] = slot[offset:offset + nbytes].view(dtype).view(shape)
        for j, index in enumerate(self.streamed):
            layers[index].register_forward_pre_hook(self._hook(j))
        if self.streamed[0] != 0:  # the first copy overlaps the resident layers
            layers[0].register_forward_pre_hook(self._start)

    def _hook(self, j: int):  # noqa: ANN202 - a forward pre-hook
        def acquire(_module: nn.Module, _args: Any) -> None:
            self._acquire(j)
        return acquire

    def _start(self, _module: nn.Module, _args: Any) -> None:
        if self._next == 0:
            self._issue(0)

    def _issue(self, j: int) -> None:
        """Copy streamed layer j into its slot once the compute stream has passed the
        layer that used the slot before it."""
        streamed = self._layers[j]
        slot = self._slots[j % len(self._slots)][: streamed.host.numel()]
        self._next = j + 1
        if not self._cuda:
            slot.copy_(streamed.host)
            return
        compute = torch.cuda.current_stream(self.device)
        self._copy_stream.wait_stream(compute)
        with torch.cuda.stream(self._copy_stream):
            slot.copy_(streamed.host, non_blocking=True)
            if streamed.copied is None:
                streamed.copied = torch.cuda.Event()
            streamed.copied.record(self._copy_stream)

    def _acquire(self, j: int) -> None:
        """Before streamed layer j: its copy issued (and, on CUDA, waited for by the
        compute stream), then the next one's copy issued behind it."""
        if self._next != j + 1:  # not issued ahead (the first layer, or an odd order)
            self._issue(j)
        if self._cuda:
            torch.cuda.current_stream(self.device).wait_event(self._layers[j].copied)
        if j + 1 < len(self._layers) and len(self._slots) > 1:
            self._issue(j + 1)
        elif j + 1 == len(self._layers):
            self._next = 0  # the next forward starts over
