"""The Ray backend's connection: connecting to a cluster (bounded: ``cluster_probe``) or
starting a local one, and undoing what ``ray.init`` changes in this process.
"""

from __future__ import annotations

import os
import secrets
import signal
import sys
import time

from .cluster_probe import check_reachable, start_hint
from .errors import PoolError
from .ray_logs import ray_logs_to_stderr
from .ray_reaper import Reaper

# Plain-text actor output, never merged across workers; no usage stats; no C++ failure-signal
# handler, which prints "*** SIGTERM received ... PC: @ ..." on a plain SIGTERM of the driver.
QUIET_ENV = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_DEDUP_LOGS": "0", "RAY_COLOR_PREFIX": "0",
             "RAY_DISABLE_FAILURE_SIGNAL_HANDLER": "1"}
GCS_LOSS_PATIENCE = 7 * 24 * 3600  # seconds this driver survives a lost head (Ray's default: 60)


def import_ray():
    try:
        import ray
    except ImportError:
        raise PoolError("the Ray backend needs Ray: pip install 'stageb_pool[ray]' "
                        "(.venv/bin/python -m pip install -e '.[ray]' in a checkout)") from None
    return ray


class RayConnection:
    """This process's connection to the Ray cluster at ``address`` (a local one is shut down
    by ``close``). A connection already open in this process is used and left open."""

    def __init__(self, address: str, connect_timeout: float):
        self.started = False
        self._saved_env: dict[str, str | None] = {}
        self._saved_sigterm = None
        self._log_redirect = None
        self._reaper = None
        loaded = sys.modules.get("ray")
        already = loaded is not None and loaded.is_initialized()
        if not already:
            # Set before `import ray` where possible: some of it is read at import.
            for name, value in {**QUIET_ENV, **(_local_auth_env() if address == "local" else {})}.items():
                self._setenv(name, value)
        try:
            self.ray = import_ray()
        except PoolError:
            self.close()
            raise
        if already:
            return
        target = address
        if address == "local":
            _apply_auth_env()  # ray may have been imported before the env was set
            self._reaper = Reaper()  # stops the cluster if this process dies without closing it
        else:
            deadline = time.monotonic() + connect_timeout
            try:
                target = check_reachable(address, connect_timeout)
            except PoolError:
                self.close()
                raise
            # ray.init's own GCS retries (about 1 s each) within what is left of the bound.
            self._setenv("RAY_gcs_server_port_wait_time_s", str(max(1, int(deadline - time.monotonic()))))
            # Ray ends a driver 60 s after it lost the GCS (exit 1, no exception); the pool notices
            # a lost head itself (RayTransport._check_cluster). Not for a local cluster: it inherits it.
            self._setenv("RAY_gcs_rpc_server_reconnect_timeout_s", str(GCS_LOSS_PATIENCE))
        # ray.init replaces the SIGTERM handler with one that calls sys.exit, and keeps it
        # after shutdown: restore ours in close().
        self._saved_sigterm = signal.getsignal(signal.SIGTERM)
        kwargs = dict(logging_level="WARNING", log_to_driver=True)
        if address == "local":
            kwargs["include_dashboard"] = False  # the API server still runs; nothing is served
        try:
            self.started = True  # from here on, close() shuts Ray down
            self.ray.init(address=target, **kwargs)
        except BaseException as exc:  # Ctrl-C included: leave no half-started cluster behind
            self.close()
            if not isinstance(exc, (ConnectionError, RuntimeError, ValueError)):
                raise
            raise PoolError(f"cannot connect to the Ray cluster at {address!r}{start_hint(address)}: {exc}") from None
        if callable(self._saved_sigterm):
            # The caller's own handler (the CLI's) goes on handling SIGTERM while Ray is up.
            signal.signal(signal.SIGTERM, self._saved_sigterm)
        self._log_redirect = ray_logs_to_stderr()

    def _setenv(self, name: str, value: str) -> None:
        if name not in os.environ:
            self._saved_env[name] = None
            os.environ[name] = value

    def close(self) -> None:
        """Shut Ray down if this connection started it; restore SIGTERM, the log printer and env."""
        if self.started:
            self.started = False
            if self.ray.is_initialized():
                self.ray.shutdown()
        if self._reaper is not None:
            self._reaper.stop()
            self._reaper = None
        if self._log_redirect is not None:
            self._log_redirect()
            self._log_redirect = None
        if self._saved_sigterm is not None:
            signal.signal(signal.SIGTERM, self._saved_sigterm)
            self._saved_sigterm = None
        for name in self._saved_env:
            os.environ.pop(name, None)
        self._saved_env = {}


def _local_auth_env() -> dict[str, str]:
    """Token auth for a new local cluster (whose ports listen on every interface) with a per-run
    token in the environment, not ~/.ray/auth_token. A RAY_AUTH_* the user set wins."""
    if "RAY_AUTH_MODE" in os.environ:
        return {}
    env = {"RAY_AUTH_MODE": "token"}
    if "RAY_AUTH_TOKEN" not in os.environ and "RAY_AUTH_TOKEN_PATH" not in os.environ:
        env["RAY_AUTH_TOKEN"] = secrets.token_hex(32)
    return env


def _apply_auth_env() -> None:
    """Make an already imported ray read RAY_AUTH_* again (private API: the pinned ray version)."""
    from ray._raylet import AuthenticationTokenLoader, Config

    Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()
