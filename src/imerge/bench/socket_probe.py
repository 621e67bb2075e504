"""The limit a Python data path can reach on this machine: plain sockets on loopback, measured.

A sender thread writes a tensor's memory with ``sendall`` (no intermediate
``bytes``) in frames of ``frame_bytes``; a receiver thread reads each frame
with ``recv_into`` straight into a preallocated tensor and adds it into an
accumulator (``add_``), as a shard does with a gradient. Each side's CPU time
is its own thread's (``time.thread_time``: user and system, the kernel's copies
included), per GB it moved. ``imerge bench datapath`` measures it in every
round, beside the data paths it measures, and prints the median of each frame
size's rounds (:func:`merged`): one probe before the rounds varied from one run
to the next as much as the ratios it was the measure of.
"""
from __future__ import annotations

import dataclasses
import socket
import statistics
import ssl
import threading
import time

import torch

MIB = 1 << 20


@dataclasses.dataclass(frozen=True)
class ProbeResult:
    frame_bytes: int
    receive_cpu_s_per_gb: float
    send_cpu_s_per_gb: float
    gb_per_s: float  # wall


def _receive(conn: socket.socket, frame_bytes: int, frames: int, out: dict[str, float]) -> None:
    started = time.thread_time()
    frame = torch.empty(frame_bytes // 4)
    total = torch.zeros(frame_bytes // 4)
    view = memoryview(frame.numpy().data).cast("B")
    for _ in range(frames):
        received = 0
        while received < frame_bytes:
            count = conn.recv_into(view[received:], frame_bytes - received)
            if not count:
                raise ConnectionError("the probe's sender closed early")
            received += count
        total.add_(frame)
    out["cpu"] = time.thread_time() - started


def _handshake(receiver: socket.socket, sender: socket.socket, tls: tuple[ssl.SSLContext, ssl.SSLContext]
               ) -> tuple[socket.socket, socket.socket]:
    """Both ends wrapped in TLS (the server's handshake on a thread of its own)."""
    server: list[socket.socket] = []
    thread = threading.Thread(target=lambda: server.append(tls[0].wrap_socket(receiver, server_side=True)),
                              daemon=True)
    thread.start()
    client = tls[1].wrap_socket(sender, server_hostname="localhost")
    thread.join(60)
    if not server:
        raise RuntimeError("the probe's TLS handshake did not complete")
    return server[0], client


def probe(frame_bytes: int = 4 * MIB, total_bytes: int = 1 << 30,
          tls: tuple[ssl.SSLContext, ssl.SSLContext] | None = None) -> ProbeResult:
    """Move ``total_bytes`` over one loopback TCP connection; each side's CPU seconds per GB. ``tls``: (server,
    client) contexts, to measure what TLS costs (the client verifies the name ``localhost``)."""
    frames = max(1, total_bytes // frame_bytes)
    listener = socket.create_server(("127.0.0.1", 0))
    sender = socket.create_connection(listener.getsockname(), timeout=60)
    receiver, _ = listener.accept()
    listener.close()
    receiver.settimeout(60)
    if tls is not None:
        receiver, sender = _handshake(receiver, sender, tls)
    received: dict[str, float] = {}
    thread = threading.Thread(target=_receive, args=(receiver, frame_bytes, frames, received), daemon=True)
    payload = memoryview(torch.ones(frame_bytes // 4).numpy().data).cast("B")
    try:
        wall = time.perf_counter()
        thread.start()
        cpu = time.thread_time()
        for _ in range(frames):
            sender.sendall(payload)
        send_cpu = time.thread_time() - cpu
        thread.join(60)
        wall = time.perf_counter() - wall
    finally:
        sender.close()
        receiver.close()
    if "cpu" not in received:
        raise RuntimeError("the probe's receiver did not finish within 60 s")
    gigabytes = frames * frame_bytes / 1e9
    return ProbeResult(frame_bytes, received["cpu"] / gigabytes, send_cpu / gigabytes, gigabytes / wall)


def probes(sizes: tuple[int, ...] = (1 * MIB, 4 * MIB)) -> list[ProbeResult]:
    return [probe(size) for size in sizes]


def merged(rounds: list[list[ProbeResult]]) -> list[ProbeResult]:
    """Each frame size's probes over the rounds, in the order of the first round: the median of each measure."""
    if not rounds:
        return []
    by_size: dict[int, list[ProbeResult]] = {}
    for result in (result for round_ in rounds for result in round_):
        by_size.setdefault(result.frame_bytes, []).append(result)
    return [ProbeResult(size, statistics.median(r.receive_cpu_s_per_gb for r in results),
                        statistics.median(r.send_cpu_s_per_gb for r in results),
                        statistics.median(r.gb_per_s for r in results))
            for size, results in by_size.items()]
