"""``imerge worker --nproc-per-node N [-- CMD]``: the worker processes of one node (a pod of the chart's GPU workers).

This process starts N ``imerge worker`` processes (or N processes of a training
script ``CMD``) with ranks ``node_rank * N + i`` and local ranks ``i`` (each
takes GPU ``i``, and metrics port base + ``i``), with torchrun's variables
(:func:`torchrun_env`; ``MASTER_ADDR``/``MASTER_PORT`` as this process has them),
forwards SIGTERM to them, and waits. It exits with what the node's workers
say together: 76 if any failed fatally, the first other failure's code (the
others are stopped), 75 if any left to rejoin a recovered job (the pod is
restarted), else 0.
"""
from __future__ import annotations

import logging
import os
from pathlib import Path
import signal
import sys
import time
from typing import Any

from imerge.core.config import to_env
from imerge.core.errors import EXIT_FATAL, EXIT_REJOIN
from imerge.ops import proc

log = logging.getLogger(__name__)


def torchrun_env(rank: int, world_size: int, per_node: int, master: tuple[str, int]) -> dict[str, str]:
    """torchrun's variables for worker ``rank``, so that a script's own ``dist.init_process_group()``,
    DistributedSampler and rank-0 logging work beside IMerge (``per_node``: processes per node, 0: all on one)."""
    local_size = per_node or world_size
    return {"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank % local_size),
            "LOCAL_WORLD_SIZE": str(local_size), "GROUP_RANK": str(rank // local_size), "ROLE_RANK": str(rank),
            "ROLE_WORLD_SIZE": str(world_size), "GROUP_WORLD_SIZE": str(-(-world_size // local_size)),
            "MASTER_ADDR": master[0], "MASTER_PORT": str(master[1])}


def child_env(worker: Any, job: Any, local: int) -> dict[str, str]:
    """A node's ``local``-th worker: this process's options, as one rank of its own."""
    node = worker.node_rank if worker.node_rank >= 0 else worker.rank
    rank = node * worker.nproc_per_node + local
    env = {**os.environ, **to_env(worker), **to_env(job)}
    master = (os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ.get("MASTER_PORT", "29500")))
    env.update(torchrun_env(rank, worker.world_size, worker.nproc_per_node, master))
    env.update(IMERGE_RANK=str(rank), IMERGE_LOCAL_RANK=str(local), IMERGE_NPROC_PER_NODE="1",
               IMERGE_NODE_RANK="-1")
    if worker.metrics_port > 0:
        env["IMERGE_METRICS_PORT"] = str(worker.metrics_port + local)
    if worker.ports_file:  # one file per process: worker.json -> worker.local1.json, ...
        path = Path(worker.ports_file)
        env["IMERGE_PORTS_FILE"] = str(path.with_name(f"{path.stem}.local{local}{path.suffix}")) if local else \
            worker.ports_file
    return env


def node_exit_code(codes: list[int]) -> int:
    if EXIT_FATAL in codes:
        return EXIT_FATAL
    failed = [code for code in codes if code not in (0, EXIT_REJOIN)]
    if failed:
        return failed[0] if failed[0] > 0 else 1
    return EXIT_REJOIN if EXIT_REJOIN in codes else 0


def run_node(worker: Any, job: Any, command: list[str] | None = None, grace_s: float = 30.0) -> int:
    argv = command or [sys.executable, "-m", "imerge", "worker"]
    children = [proc.spawn(argv, env=child_env(worker, job, local)) for local in range(worker.nproc_per_node)]
    log.info("started %d workers: pids %s", len(children), [c.pid for c in children])

    def forward_sigterm(*_: Any) -> None:
        for child in children:
            proc.signal_group(child, signal.SIGTERM)

    signal.signal(signal.SIGTERM, forward_sigterm)
    codes: dict[int, int] = {}
    while len(codes) < len(children):
        for index, child in enumerate(children):
            code = child.poll()
            if code is None or index in codes:
                continue
            codes[index] = code
            if code not in (0, EXIT_REJOIN):  # a failure: the node's other workers cannot go on without it
                log.error("worker process %d (local rank %d) exited with %d; stopping the others", child.pid,
                          index, code)
                for other in children:
                    proc.stop(other, grace_s)
        time.sleep(0.2)
    return node_exit_code([codes[i] for i in range(len(children))])
