"""The baseline users would otherwise pick: the built-in job on torch DistributedDataParallel.

Run as the workers of ``imerge launch``/``imerge testbed`` (``-- python -m imerge.bench.ddp_baseline``):
rank and world size from ``IMERGE_RANK``/``IMERGE_WORLD_SIZE``, the rendezvous at
``IMERGE_DDP_MASTER`` (host:port of worker 0), the job from the same ``IMERGE_*`` variables as
``imerge worker``. The optimizer runs locally on every worker, as DDP does. The model goes where
``--device`` says (``LOCAL_RANK`` picks the GPU); ``IMERGE_DDP_BACKEND`` is ``auto`` (NCCL on a GPU, else
gloo), ``gloo`` or ``nccl``. A rank that has not finished its first iteration within ``IMERGE_DDP_STARTUP_S``
seconds (default 100) prints its threads' stacks and exits 1, and the launcher starts it again.
"""
from __future__ import annotations

import datetime
import faulthandler
import logging
import os
import sys
import time
from typing import NoReturn

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from imerge.telemetry import progress
from imerge.core.config import from_env, setup_logging
from imerge.core.devices import resolve_device
from imerge.core.memory import keep_freed_memory
from imerge.workloads.data import make_dataset, worker_loader
from imerge.workloads.models import build_model
from imerge.workloads.job import JobConfig

log = logging.getLogger("imerge.bench.ddp_baseline")
_KEPT: list[object] = []  # the DDP model and its optimizer, never freed (see leave)
STARTUP_WATCHDOG_S = 100.0  # the rendezvous and the first iteration (init_process_group's own timeout: 120 s)


def main() -> int:
    job = from_env(JobConfig)
    rank, world = int(os.environ["IMERGE_RANK"]), int(os.environ["IMERGE_WORLD_SIZE"])
    setup_logging(os.environ.get("IMERGE_LOG_LEVEL", "INFO"), f"ddp{rank}")
    keep_freed_memory()  # as IMerge's workers do: the comparison is of the data paths, not of malloc's settings
    if job.torch_threads:
        torch.set_num_threads(job.torch_threads)
    local_rank = int(os.environ.get("IMERGE_LOCAL_RANK") or os.environ.get("LOCAL_RANK") or -1)
    device = resolve_device(job.device, local_rank, rank)
    backend = os.environ.get("IMERGE_DDP_BACKEND", "auto")
    if backend == "auto":
        backend = "nccl" if device.type == "cuda" else "gloo"
    # A rank that has not finished its first iteration by then prints every thread's stack to its log and exits
    # 1, which the launcher restarts: a rank stuck in torch's rendezvous past init_process_group's own timeout.
    # (The testbed's hang blamed on the rendezvous, one clean-clone suite run in three, was, where a stack was
    # caught, the deadlock at the rank's exit that keep() prevents: see leave.)
    faulthandler.dump_traceback_later(float(os.environ.get("IMERGE_DDP_STARTUP_S", STARTUP_WATCHDOG_S)), exit=True)
    dist.init_process_group(backend, init_method=f"tcp://{os.environ.get('IMERGE_DDP_MASTER', '127.0.0.1:29500')}",
                            rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))
    log.info("DDP rank %d of %d on %s with %s", rank, world, device, backend)
    model = DistributedDataParallel(build_model(job.model, job.seed).to(device), bucket_cap_mb=25,
                                    device_ids=[device.index] if device.type == "cuda" else None)
    optimizer = job.optimizer_spec().build(list(model.parameters()))
    train = make_dataset(job.data, job.model, "train", job.seed, job.samples)
    total = job.iters or job.epochs * len(worker_loader(train, job.batch_size, rank, world, job.seed))
    iteration, epoch = 0, 0
    while iteration < total:
        for x, y in worker_loader(train, job.batch_size, rank, world, job.seed, epoch):
            tick = time.monotonic()
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = torch.nn.functional.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            iteration += 1
            if iteration == 1:
                faulthandler.cancel_dump_traceback_later()
            progress.report(iteration=iteration, total=total, loss=loss.detach().item(),
                            seconds=time.monotonic() - tick)
            if iteration >= total:
                break
        epoch += 1
    dist.barrier()
    dist.destroy_process_group()
    progress.report("summary", iterations=iteration, loss=loss.detach().item())
    keep(model, optimizer)
    return 0


def keep(*objects: object) -> None:
    """Never free ``objects`` (a DDP model, what holds one): the process leaves without destructors (see leave)."""
    _KEPT.extend(objects)


def leave(status: int) -> NoReturn:
    """Ends the process without the interpreter's teardown, and without freeing the DDP model (``main`` passes
    it to :func:`keep`). torch 2.13's gloo worker thread drops its last reference to a collective launched during
    backward() after the rank has seen it complete, and that drop takes the GIL (the collective holds the
    autograd engine's Python context). When the rank reaches finalization first, Python ends the waiting thread
    and its unwinding aborts the process ("terminate called without an active exception"): 12 of 120 runs of
    examples/gpt_ddp.py under torchrun here, each after all its work was done. When the model is freed first,
    its Reducer's process group joins that thread while holding the GIL the thread waits for, and the rank
    never ends: the tiny benchmark's hang, one clean-clone suite run in a few (``py-spy dump --native``: the
    main thread in ``~ProcessGroupGloo`` -> ``std::thread::join``, the gloo thread in
    ``~AsyncBarrierWork`` -> ``gil_scoped_acquire``)."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


if __name__ == "__main__":
    leave(main())
