"""What a failed CUDA graph capture leaves behind, step by step (a device diagnostic for
decode_step.recover_from_failed_capture): the default generator's state, the current
stream, the capture pool's recording entry. Prints one line per check."""

from __future__ import annotations

import torch


def _try(name: str, fn) -> None:
    try:
        fn()
        print(f"{name}: ok")
    except Exception as error:  # noqa: BLE001 - a diagnostic reports every failure
        print(f"{name}: {type(error).__name__}: {str(error).splitlines()[0]}")


def main() -> None:
    x = torch.ones(4, device="cuda")
    pool = torch.cuda.graph_pool_handle()
    before = torch.cuda.current_stream()
    stream = torch.cuda.Stream()
    graph = torch.cuda.CUDAGraph()

    def failing() -> None:
        with torch.cuda.graph(graph, pool=pool, stream=stream, capture_error_mode="thread_local"):
            (x * 2).sum().item()

    _try("failing capture", failing)
    print("current stream restored:", torch.cuda.current_stream() == before)
    torch.cuda.set_stream(before)
    _try("randn after failure", lambda: torch.randn(2, device="cuda"))
    print("pool handle:", pool, type(pool).__name__)
    _try("endAllocateToPool", lambda: torch._C._cuda_endAllocateToPool(0, pool))
    from exl3cli.engine.generation.decode_step import recover_from_failed_capture
    _try("recover", lambda: recover_from_failed_capture(torch.device("cuda", 0), None))
    _try("randn after recovery", lambda: torch.randn(2, device="cuda"))

    def again() -> None:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=pool, stream=torch.cuda.Stream()):
            x.mul_(1)
    _try("capture into the same pool", again)


if __name__ == "__main__":
    main()
