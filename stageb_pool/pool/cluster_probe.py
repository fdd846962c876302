"""Is there a Ray cluster at this address that will take us? Answered within a bound, before
``ray.init``, which has none (docs/architecture.md, "The Ray backend", Connecting): a TCP
connect to the GCS port, then a ``GcsClient`` in a thread (it checks the auth token).
"""

from __future__ import annotations

import os
import socket
import threading
import time

from .errors import PoolError

CONNECT_TIMEOUT = 45.0  # seconds; a reachable head answers in milliseconds


def check_reachable(address: str, timeout: float) -> str:
    """The GCS ``host:port`` that ``address`` names, once it answers and accepts this process;
    else a PoolError naming the address and the cause, within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    gcs, source = resolve(address)
    named = f"{address!r}" if gcs == address else f"{address!r} ({source} {gcs})"
    host, _, port = gcs.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=max(0.1, deadline - time.monotonic())):
            pass
    except ConnectionRefusedError:
        raise PoolError(f"cannot connect to the Ray cluster at {named}: nothing is listening there "
                        f"(connection refused){start_hint(address)}") from None
    except (socket.timeout, TimeoutError):
        raise PoolError(f"cannot connect to the Ray cluster at {named}: no answer within {timeout:g} s "
                        "(connect_timeout)") from None
    except OSError as exc:
        raise PoolError(f"cannot connect to the Ray cluster at {named}: {exc.strerror or exc}") from None
    error = _ask_gcs(gcs, deadline)
    if error is None:
        return gcs
    if error == "timeout":
        raise PoolError(f"cannot connect to the Ray cluster at {named}: the port accepts connections but no "
                        f"Ray GCS answered within {timeout:g} s (connect_timeout; is it a Ray head's port?)")
    if type(error).__name__ == "AuthenticationError":
        mine = "" if address != "auto" else (
            "; 'auto' never joins a cluster it cannot authenticate to: it may be another run's private "
            "cluster (give --ray HOST:PORT, or start your own with `ray start --head`)")
        sent = ("this process's auth token (RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token)"
                if os.environ.get("RAY_AUTH_MODE") == "token" else
                "this process, which sent no auth token (set RAY_AUTH_MODE=token and RAY_AUTH_TOKEN)")
        raise PoolError(f"cannot connect to the Ray cluster at {named}: it refused {sent}{mine}: "
                        f"{_first_sentence(error)}")
    raise PoolError(f"cannot connect to the Ray cluster at {named}: {type(error).__name__}: {_first_sentence(error)}")


def gcs_answers(gcs: str, timeout: float = 1.0) -> bool:
    """Whether the GCS still accepts a connection (Ray's state queries block while it is gone)."""
    host, _, port = gcs.rpartition(":")
    return port_answers(host, port, timeout)


def port_answers(host: str, port, timeout: float) -> bool:
    """Whether ``host:port`` accepts a TCP connection within ``timeout`` seconds."""
    try:
        with socket.create_connection((host, int(port)), timeout=timeout):
            return True
    except (OSError, ValueError):
        return False


def resolve(address: str) -> tuple[str, str]:
    """``(host:port, where it came from)``, by Ray's own lookup for ``"auto"``."""
    from ray._private import services

    if address != "auto":
        source = "resolved"  # Ray replaces 127.0.0.1 and localhost by this machine's address
    else:
        source = "from RAY_ADDRESS" if os.environ.get("RAY_ADDRESS") else "found on this machine"
    try:
        gcs = services.canonicalize_bootstrap_address(address)
    except (ConnectionError, ValueError) as exc:
        raise PoolError(f"cannot connect to the Ray cluster at {address!r}: {_first_sentence(exc)}"
                        f"{start_hint(address)}") from None
    if gcs is None:  # only "local" resolves to nothing, and it is never probed
        raise PoolError(f"no Ray cluster address in {address!r}")
    return gcs, source


def _ask_gcs(gcs: str, deadline: float):
    """None if the GCS at ``gcs`` accepts this process; else its exception, or "timeout"."""
    from ray._raylet import GcsClient

    box: dict = {}

    def ask():
        try:
            box["client"] = GcsClient(address=gcs)  # fetches the cluster id: the token is checked here
        except Exception as exc:  # noqa: BLE001 - reported by the caller
            box["error"] = exc

    # A daemon thread: if the GCS never answers, the process may still exit (the thread
    # gives up by itself after Ray's own 40 s).
    thread = threading.Thread(target=ask, name="stageb_pool-ray-connect", daemon=True)
    thread.start()
    thread.join(max(0.0, deadline - time.monotonic()))
    if thread.is_alive():
        return "timeout"
    return box.get("error")


def _first_sentence(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    head, dot, _ = text.partition(". ")
    return head + dot.strip() if head else type(exc).__name__


def start_hint(address: str) -> str:
    return " (start one with `ray start --head`, or use address 'local')" if address == "auto" else ""
