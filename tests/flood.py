"""Strangers on a shard's data channel: connections that never complete a HELLO, kept up by a thread."""
from __future__ import annotations

import contextlib
import select
import socket
import threading
import time

from imerge.wire.datapath import HEADER, MAGIC, Kind


class Flood:
    """``count`` connections to each of ``ports``, each sending a HELLO's header declaring a ``meta_len``-byte
    meta and one byte of it, then a byte every ``drip_s`` (never silent for the idle limit); each one the
    shard ends is counted and opened again at once, until :meth:`stop`."""

    def __init__(self, ports: list[int], count: int, meta_len: int = 64, drip_s: float = 0.5):
        self.ports, self.count, self.drip_s = ports, count, drip_s
        self.hello = HEADER.pack(MAGIC, Kind.HELLO, 0, 0, meta_len, 0) + b"\0"
        self.opened = self.ended = 0
        self.lifetimes: list[float] = []  # seconds from open to the shard's end, of each ended connection
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="flood", daemon=True)
        self._thread.start()

    def _open(self, port: int) -> tuple[socket.socket, float] | None:
        try:
            sock = socket.create_connection(("127.0.0.1", port), timeout=2)
            sock.sendall(self.hello)
        except OSError:
            return None
        sock.setblocking(False)
        self.opened += 1
        return sock, time.monotonic()

    def _run(self) -> None:
        open_: dict[int, tuple[socket.socket, float, int]] = {}  # fd -> (socket, opened at, port)
        poller = select.poll()
        last_drip = time.monotonic()
        try:
            while not self._stop.is_set():
                for port in self.ports:
                    missing = self.count - sum(1 for _, _, p in open_.values() if p == port)
                    for _ in range(missing):
                        opened = self._open(port) if not self._stop.is_set() else None
                        if opened is None:
                            break
                        open_[opened[0].fileno()] = (*opened, port)
                        poller.register(opened[0], select.POLLIN)
                for fd, _ in poller.poll(0):  # readable: the shard's end (or an ERROR frame before it)
                    sock, since, _ = open_.pop(fd)
                    poller.unregister(fd)
                    self.ended += 1
                    self.lifetimes.append(time.monotonic() - since)
                    sock.close()
                if time.monotonic() - last_drip >= self.drip_s:
                    last_drip = time.monotonic()
                    for sock, _, _ in open_.values():
                        with contextlib.suppress(OSError):
                            sock.send(b"\0")
                self._stop.wait(0.05)
        finally:
            for sock, _, _ in open_.values():
                sock.close()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)
