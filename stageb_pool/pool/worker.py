"""The forked worker, a child of the zygote: the process around a ``WorkerCore`` (line-buffered
stdio for the zygote's relay, the thread limits, also the Ray actor's, and the socket loop).
"""

from __future__ import annotations

import os
import sys

from . import cancellation, protocol
from .worker_core import WorkerCore


def limit_threads(device, *, pin_gpu: bool = True) -> None:
    """Pin devices and thread counts before anything can initialise CUDA or OpenMP.
    ``pin_gpu=False`` where someone else chose the GPU (Ray sets CUDA_VISIBLE_DEVICES)."""
    if device.kind == "cuda" and pin_gpu:
        os.environ["CUDA_VISIBLE_DEVICES"] = device.visible_devices()
    os.environ["OMP_NUM_THREADS"] = str(device.threads)
    os.environ["MKL_NUM_THREADS"] = str(device.threads)
    torch = sys.modules.get("torch")
    if torch is not None:
        # Must happen before the first torch op in this process (fork + OpenMP deadlock).
        torch.set_num_threads(device.threads)


def _line_buffered_stdio() -> None:
    # fds 1 and 2 are pipes to the zygote, which prefixes each line with our rank; line
    # buffering makes prints appear promptly and never lost at os._exit.
    sys.stdout = open(1, "w", buffering=1, closefd=False, errors="backslashreplace")
    sys.stderr = open(2, "w", buffering=1, closefd=False, errors="backslashreplace")


def worker_main(sock, device, engine_factory, max_frame: int) -> int:
    """Start the engine, then answer requests until Shutdown or EOF; 1 if the engine did not start."""
    _line_buffered_stdio()
    limit_threads(device)
    core = WorkerCore(engine_factory, device, max_frame)
    cancellation.listen(sock)
    sock.sendall(core.hello())
    while core.serving and (request := protocol.recv_body(sock, max_frame)) is not None:
        if reply := core.answer(request):  # a Share, Cancel or Shutdown needs none
            sock.sendall(reply)
    return 0 if core.started else 1
