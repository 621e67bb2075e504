"""Processes forked or spawned from a training script (DataLoader workers, multiprocessing, os.fork) never act as
the model's process: no exit hook, no done mark, no lease release, no connection use in the child."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from imerge.core.errors import UnsupportedUse
from imerge.core.optim import OptimizerSpec

SCRIPT = Path(__file__).resolve().parent / "scripts" / "loader_epochs.py"
LOADERS = {  # name -> the script's DataLoader options
    "no loader workers": [],
    "2 forked": ["--loader-workers", "2"],
    "4 forked, persistent": ["--loader-workers", "4", "--persistent"],
    # a spawned loader worker imports torch and the script (2 s of CPU each): one per epoch and rank, or two for
    # the whole run, show what four would
    "1 spawned": ["--loader-workers", "1", "--context", "spawn"],
    "2 spawned, persistent": ["--loader-workers", "2", "--context", "spawn", "--persistent"],
}


def launch_script(folder: Path, *script_args: str) -> subprocess.Popen:
    """Two epochs of 6 iterations per rank: the second shows what every later epoch does."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("IMERGE_")}
    return subprocess.Popen([sys.executable, "-m", "imerge", "launch", "--shards", "1", "--workers", "2",
                             "--log-dir", str(folder / "logs"), "--", sys.executable, str(SCRIPT),
                             "--out", str(folder / "out.json"), "--epochs", "2", *script_args],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finished(run: subprocess.Popen, folder: Path) -> dict:
    output, _ = run.communicate(timeout=300)
    assert run.returncode == 0, output
    assert "fork_posix" not in output, output  # gRPC's fork handlers are off: no line per fork
    return json.loads((folder / "out.json").read_text())


@pytest.fixture(scope="module")
def loader_runs(tmp_path_factory) -> dict[str, dict]:
    """name -> what rank 0 wrote, for each of LOADERS, launched together (each job has its own Redis and ports)."""
    started = {}
    for name, options in LOADERS.items():
        folder = tmp_path_factory.mktemp(name.replace(" ", "-").replace(",", ""))
        started[name] = (launch_script(folder, *options), folder)
    return {name: finished(run, folder) for name, (run, folder) in started.items()}


@pytest.mark.timeout(400)
@pytest.mark.parametrize("name", [name for name in LOADERS if name != "no loader workers"])
def test_dataloader_workers_leave_the_job_alone(loader_runs, name):
    """Same parameters, bit for bit, as without loader workers; no done mark before the last epoch; no epoch
    waits for its forked loader workers (one that ran the exit hook made the loader's shutdown wait 5 s for it
    before killing it, every epoch; a spawned one's epochs take its start, importing torch). The jobs run side by
    side, so an epoch is compared with the same epoch of the job without loader workers."""
    reference, run = loader_runs["no loader workers"], loader_runs[name]
    assert run["iterations"] == reference["iterations"] == 12
    assert run["state"] == reference["state"]
    for epoch in run["epochs"][:-1]:
        assert epoch["done"] == [], run["epochs"]
    if "forked" in name:
        for epoch, without in zip(run["epochs"][1:], reference["epochs"][1:]):
            assert epoch["seconds"] < without["seconds"] + 4.0, (run["epochs"], reference["epochs"])


@pytest.mark.timeout(400)
def test_a_worker_killed_mid_run_with_loader_workers_recovers_to_the_same_parameters(tmp_path, loader_runs):
    """kill -9 of worker 1 in the second epoch (its loader workers then exit): the job recovers from the shards'
    checkpoint, both workers rejoin, and the result is the uninterrupted run's, bit for bit."""
    run = launch_script(tmp_path, "--loader-workers", "2", "--crash-at", "10")
    result = finished(run, tmp_path)
    assert (tmp_path / "out.json.crashed1").exists()
    assert result["state"] == loader_runs["no loader workers"]["state"]
    coordinator = (tmp_path / "logs" / "coordinator.log").read_text()
    assert "generation 1" in coordinator, coordinator[-3000:]


def test_a_forked_child_disowns_the_model_and_the_parent_keeps_it(lone):
    """In a forked child the exit hook does nothing and the model refuses use, naming why; the module itself is a
    plain local module there. The parent's job is untouched: it trains on and closes normally."""
    from imerge.control.store import Store
    from imerge.worker import exiting

    model = lone(torch.nn.Linear(4, 2), OptimizerSpec("sgd", lr=0.1))
    x = torch.ones(3, 4)
    F.mse_loss(model(x), torch.zeros(3, 2)).backward()
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report what it saw, then leave through the exit hooks (as multiprocessing does)
        os.close(read)
        try:
            try:
                model(x)
                seen = "model usable"
            except UnsupportedUse as exc:
                seen = str(exc)
            local = model.module(x).shape == (3, 2)  # a plain module: no hook waits on the parent's comm thread
            exiting.leave_at_exit()
            os.write(write, json.dumps([seen, local, model._closed]).encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read) as pipe:
        seen, local, closed = json.loads(pipe.read())
    assert os.waitpid(pid, 0)[1] == 0
    assert "a process forked from the training script's" in seen and local and closed
    store = Store(model.config.redis_url, model.config.job)
    try:
        assert store.done_ranks() == set()
        F.mse_loss(model(x), torch.zeros(3, 2)).backward()  # the parent's lease and connections are intact
        model.close()
        assert store.done_ranks() == {0}
    finally:
        store.close()


REFUSAL_SCRIPT = Path(__file__).resolve().parent / "scripts" / "caught_refusal.py"
REFUSALS = {"backward-twice": "a second backward after iteration 3 without a forward",
            "lr": "the workers' learning-rate (or other) schedules disagree"}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("refusal,handling", [("backward-twice", "exit1"), ("lr", "exit1"), ("lr", "swallow")])
def test_a_fatal_refusal_the_script_catches_still_fails_the_job_at_once_naming_it(tmp_path, refusal, handling):
    """Caught and turned into sys.exit(1), or swallowed and the script ends normally: the worker ends with 76 (not
    restarted), never marks itself done, and the launcher fails the job naming the refusal well inside the
    120 s a restarted worker would wait for a generation."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("IMERGE_")}
    started = time.monotonic()
    run = subprocess.run([sys.executable, "-m", "imerge", "launch", "--shards", "1", "--workers", "2",
                          "--log-dir", str(tmp_path / "logs"), "--", sys.executable, str(REFUSAL_SCRIPT),
                          "--refusal", refusal, "--handling", handling],
                         env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=240)
    took_s, output = time.monotonic() - started, " ".join(run.stdout.split())
    assert run.returncode == 1, output
    assert took_s < 60, output
    assert REFUSALS[refusal] in output.split("failed:", 1)[-1], output  # the job's failure names it
    assert "restarting it" not in output and "waiting for" not in output.split("failed:", 1)[-1], output
    workers = "".join((tmp_path / "logs" / f"worker{rank}.log").read_text() for rank in (0, 1))
    coordinator = (tmp_path / "logs" / "coordinator.log").read_text()
    if "Traceback" not in workers:  # the script's own handler did not print it: the job failed first, on the
        # worker's report of the refusal, and the launcher stopped the workers before their next call raised it
        assert REFUSALS[refusal] in coordinator and "ERROR" in coordinator, (workers, coordinator)
    assert "finished" not in coordinator, coordinator
