"""``imerge launch``: a whole job on one host, with no manual setup.

Starts Redis (unless ``--redis-url`` names one), the coordinator, S shards and
W workers as child processes on loopback, shows worker 0's progress, and
stops every child on success, on failure (naming the role that failed) and on
Ctrl-C or SIGTERM. Each child runs in its own process group and is killed by
the kernel if the launcher itself dies, so no process is left behind.

A shard or worker that dies before the job is done, or a coordinator killed by
a signal, is restarted, up to ``--max-restarts`` times per role, with the same
address and options; the shards write checkpoints into the log folder, so the
job recovers from them. (A coordinator that exits with an error ended the job
on purpose: it is not restarted.)
A worker that exits with code 75 (the job recovered, it rejoins) is restarted
without counting; one that exits with code 76 (a fatal error, which a restart
would repeat) fails the job at once, as does one that fails after it finished its part of the job (a restart
would wait for a job that is over). ``roles.json`` in the log folder names each role's pid.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import select
import signal
import statistics
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from imerge.ops import proc
from imerge.ops.node import torchrun_env
from imerge.core.config import option, redacted, require
from imerge.core.errors import EXIT_FATAL, EXIT_REJOIN, ChildFailed, IMergeError
from imerge.core.ports import bind_problem
from imerge.telemetry.metrics import prometheus_config, rules_file
from imerge.telemetry.progress import PROGRESS_FD_ENV
from imerge.ops.redis_server import RedisServer, find_redis_server, free_port
from imerge.ops.startup import TRAINING, Startup, stage_line, waiting_for
from imerge.workloads.job import STATE_FILE

log = logging.getLogger(__name__)
ERRORS_SHOWN = 5  # a role's error lines the console shows
METRICS_PORT = 9400  # every role's /metrics port where each role has its own host (testbed, compose, k8s)
MAX_REJOINS = 50  # exits with code 75 tolerated per worker (each follows a recovery of the job)
TEE_DRAIN_S = 5.0  # how long an exited script's last output may take to reach its log
MASTER_PORT = 29500  # torchrun's default, where each role has its own host
_ERROR_LINE = re.compile(r"^\s*([A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt|Warning)\b.*)$")


@dataclasses.dataclass(frozen=True)
class LaunchConfig:
    workers: int = option(2, "number of workers")
    shards: int = option(2, "number of PS shards")
    job: str = option("", "job id (default: a fresh one per launch)")
    fresh: bool = option(False, "with --job: start it afresh even if a run of that name finished or failed in "
                                "this Redis (its keys are deleted first; without it such a job is refused)")
    redis_url: str = option("", "Redis to use (default: start an embedded redis-server)")
    log_dir: str = option("", "folder for each role's log (default: runs/<job>)")
    log_level: str = option("INFO", "logging level of the roles", choices=("DEBUG", "INFO", "WARNING", "ERROR"))
    stop_grace_s: float = option(10.0, "seconds a role gets to exit after SIGTERM before SIGKILL")
    summary_json: str = option("", "also write the run's summary to this JSON file")
    nproc_per_node: int = option(0, "worker processes per node: worker r takes local rank r mod N, its GPU (0: "
                                    "the rank modulo the GPUs torch sees)")
    max_restarts: int = option(2, "restarts of a shard or worker that died before the job finished, or of a "
                                  "coordinator killed by a signal (per role; past them the job fails naming the "
                                  "role)")

    def __post_init__(self) -> None:
        require(1 <= self.workers <= 256, "workers", "must lie in 1..256")
        require(1 <= self.shards <= 256, "shards", "must lie in 1..256")
        require(self.stop_grace_s > 0, "stop_grace_s", "must be positive")
        require(0 <= self.max_restarts <= 100, "max_restarts", "must lie in 0..100")
        require(self.nproc_per_node >= 0, "nproc_per_node", "must be >= 0")


def _figure(event: dict[str, Any], key: str, digits: int) -> str:
    value = event.get(key)
    return f"{value:.{digits}f}" if isinstance(value, (int, float)) else "-"


def _role_order(item: tuple[str, str]) -> tuple[int, str]:
    role = item[0]
    return (0 if role == "coordinator" else 1 if role.startswith("ps") else 2, role.rjust(12))


class LocalHosts:
    """Every role on this host, on loopback. Each binds port 0 (any free one) and reports what it bound in its
    ports file, so no port is picked by binding and closing it first; a restarted shard binds the port it had,
    which must still be free."""

    reports_ports = True

    def __init__(self) -> None:
        self.shard_ports: dict[int, int] = {}  # shard index -> the gRPC port it bound first

    def prefix(self, role: str) -> list[str]:
        return []

    def shard_env(self, index: int) -> dict[str, str]:
        port = self.shard_ports.get(index, 0)
        if port and bind_problem("127.0.0.1", port):
            raise IMergeError(f"ps{index} cannot be restarted at its address 127.0.0.1:{port}: "
                              f"{bind_problem('127.0.0.1', port)} (another process took the port)")
        return {"IMERGE_HOST": "127.0.0.1", "IMERGE_PORT": str(port)}

    def metrics_target(self, role: str) -> tuple[int, str]:
        """The metrics port ``role`` serves on (0: any; its ports file says which), and the address Prometheus
        scrapes ("" until it is known)."""
        return 0, ""

    def role_env(self, role: str) -> dict[str, str]:
        return {}

    def master(self) -> tuple[str, int]:
        """Where a script's own torch.distributed process group meets (MASTER_ADDR, MASTER_PORT): worker 0's
        host, a port free when the launch starts (torchrun picks its port the same way)."""
        return "127.0.0.1", free_port()


class TestbedHosts:
    """Every role in its own network namespace of a testbed, reached by its role name."""

    SHARD_PORT = 50051
    reports_ports = False

    def __init__(self, testbed: Any):
        self.testbed = testbed

    def prefix(self, role: str) -> list[str]:
        prefix: list[str] = self.testbed.exec_prefix(role)
        return prefix

    def shard_env(self, index: int) -> dict[str, str]:
        return {"IMERGE_HOST": "0.0.0.0", "IMERGE_PORT": str(self.SHARD_PORT),
                "IMERGE_ADVERTISE": f"ps{index}:{self.SHARD_PORT}"}

    def metrics_target(self, role: str) -> tuple[int, str]:
        return METRICS_PORT, f"{role}:{METRICS_PORT}"

    def role_env(self, role: str) -> dict[str, str]:
        """The role's link capacity, so its metrics report utilization against the shaped rate; /metrics on the
        namespace's address, where the host's Prometheus (the testbed's switch) reaches it."""
        env = {"IMERGE_LINK_MBPS": f"{self.testbed.links[role].rate_mbit:g}", "IMERGE_METRICS_HOST": "0.0.0.0"}
        if role == "coordinator":
            env.update(self.tuning_env())
        return env

    def tuning_env(self) -> dict[str, str]:
        """What the coordinator's --tune knows of the testbed: the shards' link rate and port queue, and the
        calibration of this machine's testbed that ships with the package (every role shares its cores)."""
        from importlib import resources

        shard = self.testbed.links["ps0"]
        calibration = resources.files("imerge.sim").joinpath("share", "testbed.json")
        env = {"IMERGE_LINK_GBIT": f"{shard.rate_mbit / 1000:g}", "IMERGE_CALIBRATION": str(calibration)}
        if shard.ingress_limit_kb:
            env["IMERGE_QUEUE_KB"] = f"{shard.ingress_limit_kb:g}"
        return {name: value for name, value in env.items() if not os.environ.get(name)}  # the user's win

    def master(self) -> tuple[str, int]:
        return "worker0", MASTER_PORT


class Interrupted(Exception):
    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@dataclasses.dataclass
class Child:
    role: str
    process: Any
    log_path: Path
    is_worker: bool
    argv: list[str]
    env: dict[str, str]
    pass_fds: tuple[int, ...] = ()
    shard: int | None = None  # a shard's index
    restarts: int = 0   # after deaths
    rejoins: int = 0    # after exit code 75 (the job recovered)
    log_read: int = 0   # bytes of the log already scanned for errors
    errors_shown: int = 0
    run_from: int = 0   # where this run's output starts in the log
    last_failure: tuple[int, str] | None = None  # (exit code, error line) of the previous run that failed
    tee: threading.Thread | None = None  # copies this run's output to the log (a script's); None once drained

    def drain(self) -> None:
        """After the process exited: wait (briefly) for its last output to reach the log, which its failure and
        the next run's start in the log are read from (the tee thread lags the process under load)."""
        if self.tee is not None:
            self.tee.join(TEE_DRAIN_S)
            self.tee = None

    def new_errors(self) -> list[str]:
        """The log's ERROR lines written since the last call (complete lines only)."""
        try:
            with self.log_path.open("rb") as stream:
                stream.seek(self.log_read)
                data = stream.read(1 << 20)
        except OSError:
            return []
        complete = data[:data.rfind(b"\n") + 1]
        self.log_read += len(complete)
        return [line for line in complete.decode(errors="replace").splitlines() if " ERROR " in line]

    def failure(self, code: int) -> tuple[int, str]:
        """This run's failure: its exit code and the last line of its output that names an error (else its last
        line), so that a run failing the same way as the one before can be told apart from a new failure."""
        try:
            with self.log_path.open("rb") as stream:
                stream.seek(self.run_from)
                lines = [line.strip() for line in stream.read().decode(errors="replace").splitlines() if line.strip()]
        except OSError:
            lines = []
        errors = [line for line in lines if _ERROR_LINE.match(line)]
        return code, (errors or lines or [""])[-1][:300]

    def tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


def worker_threads(workers: int) -> int:
    """Threads of torch per worker where ``workers`` share this host's cores: each its share, at least one (torch's
    default, every core per process, leaves several workers' OpenMP threads spinning on each other's cores)."""
    return max(1, (os.cpu_count() or 1) // workers)


class Launcher:
    def __init__(self, config: LaunchConfig, job_env: dict[str, str], command: list[str] | None = None,
                 console: Console | None = None, schedule_env: dict[str, str] | None = None,
                 hosts: LocalHosts | TestbedHosts | None = None, workers_only: bool = False, quiet: bool = False,
                 save_state: bool = False):
        self.config = config
        self.workers_only = workers_only
        self.quiet = quiet
        self.save_state = save_state  # the built-in job saves its state in the log folder (for --resume)
        self.hosts = hosts or LocalHosts()
        self.job_env = job_env
        self.schedule_env = schedule_env or {}
        self.command = command or []
        self.console = console or Console(stderr=True)
        self.job = config.job or f"job-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"
        self.token = uuid.uuid4().hex  # this run's: its roles refuse a job of the same name another run holds
        self.log_dir = Path(config.log_dir or Path("runs") / self.job)
        self.children: list[Child] = []
        self.redis: RedisServer | None = None
        self.events: list[dict[str, Any]] = []
        self.summary: dict[str, Any] = {}
        self.metrics_targets: dict[str, str] = {}  # role -> host:port of its /metrics
        self._tees: list[threading.Thread] = []  # copy scripts' output to their logs and the console

    # -- children -----------------------------------------------------------------
    def _env(self, redis_url: str, extra: dict[str, str]) -> dict[str, str]:
        env = dict(os.environ)
        env.update(IMERGE_JOB=self.job, IMERGE_REDIS_URL=redis_url, IMERGE_LOG_LEVEL=self.config.log_level,
                   IMERGE_JOB_TOKEN=self.token, PYTHONUNBUFFERED="1")
        env.update(extra)
        return env

    def _start(self, role: str, argv: list[str], env: dict[str, str], is_worker: bool = False,
               pass_fds: tuple[int, ...] = (), shard: int | None = None) -> None:
        env.update(self.hosts.role_env(role))
        if not self.workers_only and env.get("IMERGE_METRICS_PORT", "0") == "0":
            port, address = self.hosts.metrics_target(role)
            env["IMERGE_METRICS_PORT"] = str(port)
            if address:
                self.metrics_targets[role] = address
        if self.hosts.reports_ports:
            env["IMERGE_PORTS_FILE"] = str(self._ports_file(role))
            self._ports_file(role).parent.mkdir(exist_ok=True)
            self._ports_file(role).unlink(missing_ok=True)
        child = Child(role, None, self.log_dir / f"{role}.log", is_worker, argv, env, pass_fds, shard)
        child.log_path.write_bytes(b"")
        self._spawn(child)
        self.children.append(child)
        self._write_roles()

    def _spawn(self, child: Child) -> None:
        """Start ``child``, its output appended to its log; a script's output also goes to the console, each line
        prefixed with the worker's rank (as torchrun does)."""
        argv = self.hosts.prefix(child.role) + child.argv
        child.run_from = child.log_path.stat().st_size if child.log_path.exists() else 0
        if not (child.is_worker and self.command) or self.quiet:
            with open(child.log_path, "ab") as log_file:
                child.process = proc.spawn(argv, env=child.env, stdout=log_file, pass_fds=child.pass_fds)
            return
        child.process = proc.spawn(argv, env=child.env, stdout=subprocess.PIPE, pass_fds=child.pass_fds)
        prefix = f"[rank{child.role.removeprefix('worker')}]: "
        tee = threading.Thread(target=self._tee, args=(child.process.stdout, child.log_path, prefix), daemon=True,
                               name=f"imerge-tee-{child.role}")
        tee.start()
        self._tees.append(tee)
        child.tee = tee

    def _tee(self, stream: Any, log_path: Path, prefix: str) -> None:
        with stream, open(log_path, "ab") as log_file:
            for line in iter(stream.readline, b""):
                log_file.write(line)
                log_file.flush()
                self.console.print(prefix + line.decode(errors="replace").rstrip("\n"), markup=False,
                                   highlight=False, soft_wrap=True)

    def _ports_file(self, role: str) -> Path:
        return self.log_dir / "ports" / f"{role}.json"

    def _collect_ports(self) -> None:
        """Read the ports the children bound (their ports files); (re)write prometheus.yml once every role's
        metrics port is known, and whenever a restarted role bound another."""
        hosts = self.hosts
        if not isinstance(hosts, LocalHosts):  # a testbed's roles bind fixed ports in their namespaces
            return
        changed = False
        for child in self.children:
            if child.role in self.metrics_targets or child.env.get("IMERGE_METRICS_PORT") == "-1":
                continue
            try:
                ports = json.loads(self._ports_file(child.role).read_text())
            except (OSError, ValueError):
                continue
            if "grpc" in ports and child.shard is not None:
                hosts.shard_ports.setdefault(child.shard, ports["grpc"])
            if "metrics" in ports:
                self.metrics_targets[child.role] = f"127.0.0.1:{ports['metrics']}"
                changed = True
        if changed and all(c.role in self.metrics_targets for c in self.children
                           if c.env.get("IMERGE_METRICS_PORT") != "-1"):
            self._write_prometheus_config()

    def _restart(self, child: Child, why: str) -> None:
        if self.hosts.reports_ports:  # a new metrics port, reported anew; a shard its gRPC port again
            self.metrics_targets.pop(child.role, None)
            self._ports_file(child.role).unlink(missing_ok=True)
            if child.shard is not None:
                child.env.update(self.hosts.shard_env(child.shard))
        if self.quiet:
            log.warning("%s %s; restarting it", child.role, why)
        else:
            self._say("yellow", f"{child.role} {why}; restarting it")
        self._spawn(child)
        self._write_roles()

    def _write_roles(self) -> None:
        roles = {child.role: child.process.pid for child in self.children}
        (self.log_dir / "roles.json").write_text(json.dumps(roles, indent=1))

    def _start_roles(self, redis_url: str, progress_fd: int) -> None:
        cfg, role = self.config, [sys.executable, "-m", "imerge"]
        if self.workers_only:
            self._start_workers(redis_url, progress_fd, role)
            return
        self._start("coordinator", role + ["coordinator"],
                    self._env(redis_url, {"IMERGE_NUM_WORKERS": str(cfg.workers),
                                          "IMERGE_NUM_SHARDS": str(cfg.shards)}))
        for index in range(cfg.shards):
            self._start(f"ps{index}", role + ["ps"],
                        self._env(redis_url, {"IMERGE_SHARD_INDEX": str(index), "OMP_NUM_THREADS": "1",
                                              "IMERGE_CHECKPOINT_DIR": os.environ.get("IMERGE_CHECKPOINT_DIR")
                                              or str(self.log_dir / "checkpoints"),
                                              **self.hosts.shard_env(index)}), shard=index)
        self._start_workers(redis_url, progress_fd, role)

    def _threads_chosen(self) -> bool:
        """Whether the user set the workers' OMP_NUM_THREADS (the launcher's environment, or the job's)."""
        return "OMP_NUM_THREADS" in os.environ or "OMP_NUM_THREADS" in self.job_env

    def _start_workers(self, redis_url: str, progress_fd: int, role: list[str]) -> None:
        cfg = self.config
        threads = str(worker_threads(cfg.workers))
        master = self.hosts.master()
        for rank in range(cfg.workers):
            extra = {"IMERGE_RANK": str(rank), "IMERGE_WORLD_SIZE": str(cfg.workers), **self.schedule_env,
                     **torchrun_env(rank, cfg.workers, cfg.nproc_per_node, master)}
            # the GPU: the local rank with --nproc-per-node, else the rank modulo the GPUs (LOCAL_RANK is torchrun's)
            extra["IMERGE_LOCAL_RANK"] = str(rank % cfg.nproc_per_node) if cfg.nproc_per_node else "-1"
            argv = self.command or role + ["worker"]
            extra.update(self.job_env)
            if self.save_state and not self.command and not extra.get("IMERGE_STATE_FILE"):
                extra["IMERGE_STATE_FILE"] = str(self.log_dir / STATE_FILE)
            if not self.command or self.workers_only:
                if self.job_env.get("IMERGE_TORCH_THREADS", "0") == "0":
                    extra["IMERGE_TORCH_THREADS"] = threads
            if not self._threads_chosen() and "OMP_NUM_THREADS" not in extra:
                extra["OMP_NUM_THREADS"] = threads  # a script's torch: the host's cores shared, as torchrun does
            fds: tuple[int, ...] = ()
            if rank == 0:
                extra[PROGRESS_FD_ENV] = str(progress_fd)
                fds = (progress_fd,)
            self._start(f"worker{rank}", argv, self._env(redis_url, extra), is_worker=True, pass_fds=fds)

    def _check_children(self, redis_url: str = "") -> bool:
        """True once every worker exited 0; restarts dead roles; ChildFailed for a role that cannot go on (a worker
        that failed after it finished its part of the job too: a restart would wait for a round that never
        comes)."""
        workers_done = True
        for child in self.children:
            code = child.process.poll()
            if code is not None:
                child.drain()
            if code is None:
                workers_done = workers_done and not child.is_worker
            elif code == 0 and (child.is_worker or child.role == "coordinator"):
                continue
            elif code == EXIT_FATAL and child.is_worker:
                raise ChildFailed(child.role, f"failed with a fatal error (exit code {code}: not restarted); "
                                              f"last lines of {child.log_path}:\n{child.tail()}")
            elif code == EXIT_REJOIN and child.is_worker and child.rejoins < MAX_REJOINS:
                child.rejoins += 1
                self._restart(child, "left to rejoin the recovered job")
                workers_done = False
            elif child.is_worker and int(child.role.removeprefix("worker")) in self._done_ranks(redis_url):
                raise ChildFailed(child.role, f"exited with code {code} after it finished its part of the job (its "
                                              "last round is on the shards): the script failed after training, "
                                              "and a restart would wait for a job that is over; not restarted; "
                                              f"last lines of {child.log_path}:\n{child.tail()}")
            elif (child.role != "coordinator" or code < 0) and child.restarts < self.config.max_restarts:
                failure, previous = child.failure(code), child.last_failure
                if code > 0 and failure == previous:  # it failed by itself the same way again (a bug, a missing
                    # variable): restarting repeats it; a process killed by a signal is always restarted
                    raise ChildFailed(child.role, f"failed twice the same way (exit code {code}: {failure[1]}); not "
                                                  f"restarted again; last lines of {child.log_path}:\n{child.tail()}")
                child.last_failure = failure
                child.restarts += 1
                self._restart(child, f"exited with code {code} (restart {child.restarts} of "
                                     f"{self.config.max_restarts})")
                workers_done = workers_done and not child.is_worker
            else:
                why = "exited before the workers finished" if code == 0 else f"exited with code {code}"
                if child.role != "coordinator" or code < 0:
                    why += f" after {child.restarts} restarts (--max-restarts {self.config.max_restarts})"
                raise ChildFailed(child.role, f"{why}; last lines of {child.log_path}:\n{child.tail()}")
        return workers_done

    def _done_ranks(self, redis_url: str) -> set[int]:
        """The ranks that finished their part of the job (none known where this launcher cannot read the job's
        store: the DDP baseline's workers, a testbed's Redis that only its namespaces reach)."""
        if not redis_url or self.workers_only or not self.hosts.reports_ports:
            return set()
        from imerge.control.store import Store

        store = Store(redis_url, self.job)
        try:
            return set(store.done_ranks())
        except IMergeError as exc:
            log.warning("could not read which workers finished: %s", exc)
            return set()
        finally:
            store.close()

    def _check_done(self, redis_url: str) -> None:
        """Every worker exited 0: each must have finished its part of the job (a script that never joined it, or
        left without its last sync, exits 0 too)."""
        done = self._done_ranks(redis_url)
        missing = [rank for rank in range(self.config.workers) if rank not in done]
        if missing:
            child = next(c for c in self.children if c.role == f"worker{missing[0]}")
            raise ChildFailed(child.role, "exited with code 0 without finishing its part of the job: it never "
                                          "joined it (did the script call imerge.distribute and train?); last "
                                          f"lines of {child.log_path}:\n{child.tail()}")

    def _stop_all(self) -> None:
        for child in reversed(self.children):
            if child.process.poll() is None:
                proc.signal_group(child.process, signal.SIGTERM)
        for child in reversed(self.children):
            proc.stop(child.process, self.config.stop_grace_s)
        if self.redis is not None:
            self.redis.stop()
            self.redis = None
        for tee in self._tees:
            tee.join(5)

    # -- progress -------------------------------------------------------------------
    def _read_events(self, stream: Any, buffer: list[str], timeout_s: float) -> list[dict[str, Any]]:
        ready, _, _ = select.select([stream], [], [], timeout_s)
        if not ready:
            return []
        data = os.read(stream.fileno(), 65536).decode(errors="replace")
        buffer.append(data)
        *lines, rest = "".join(buffer).split("\n")
        buffer[:] = [rest]
        events = []
        for line in lines:
            try:
                events.append(json.loads(line))
            except json.JSONDecodeError:
                log.warning("ignored a malformed progress line: %r", line[:200])
        return events

    def _startup_store(self, redis_url: str) -> Any:
        """The store the startup line is read from (None where the launcher cannot reach the job's Redis: the
        testbed's, which only its namespaces reach by name, or the DDP baseline's job without one)."""
        if self.quiet or self.workers_only or not self.hosts.reports_ports:
            return None
        from imerge.control.store import Store

        return Store(redis_url, self.job)

    def _startup(self, store: Any) -> str:
        """What the starting job waits for, as its store says ('' if the store cannot say now)."""
        try:
            return waiting_for(Startup(store.registered_shards(), self.config.shards,
                                       len(store.layouts(self.config.workers)), self.config.workers,
                                       store.latest_version(), store.job_running()))
        except IMergeError:
            return ""

    def _supervise(self, read_fd: int, redis_url: str = "") -> None:
        columns = [TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                   TextColumn("loss {task.fields[loss]}"), TextColumn("{task.fields[itime]} s/it"),
                   TimeElapsedColumn()]
        buffer: list[str] = []
        store = self._startup_store(redis_url)
        with os.fdopen(read_fd, "rb", buffering=0) as stream, \
                Progress(*columns, console=self.console, disable=self.quiet or not self.console.is_terminal) as bar:
            task = bar.add_task("starting", total=None, loss="-", itime="-")
            stage, staged, polled, last_note = "starting", "", 0.0, 0.0

            def show(line: str) -> None:  # on the bar's line; without a terminal, a line of its own per change
                nonlocal stage
                if line and line != stage:
                    stage = line
                    bar.update(task, description=line)
                    if not (self.quiet or self.console.is_terminal):
                        self.console.print(line)

            while not self._check_children(redis_url):
                self._collect_ports()
                self._show_errors()
                if store is not None and time.monotonic() - polled >= 1.0:  # until the job trains
                    polled = time.monotonic()
                    if (line := self._startup(store)) == TRAINING:
                        store.close()
                        store = None
                    show(staged or line if line == TRAINING else line)
                for event in self._read_events(stream, buffer, 0.2):
                    event["received"] = time.time()
                    self.events.append(event)
                    if event.get("event") == "schedule" and not self.quiet:
                        self._say("bold", schedule_line(event))
                    if event.get("event") == "stage":  # worker 0 profiles, then trains: said once the job trains
                        staged = stage_line(event)
                        if store is None:
                            show(staged)
                    if event.get("event") == "iteration" and store is not None:  # the job trains
                        store.close()
                        store = None
                        show(staged or TRAINING)
                    if event.get("event") == "iteration":
                        loss, itime = _figure(event, "loss", 4), _figure(event, "seconds", 3)
                        bar.update(task, completed=event.get("iteration", 0), total=event.get("total"),
                                   loss=loss, itime=itime)
                        if not (self.quiet or self.console.is_terminal) and time.monotonic() - last_note > 5:
                            last_note = time.monotonic()
                            self.console.print(f"iteration {event.get('iteration')}/{event.get('total', '?')} "
                                               f"loss {loss} {itime} s/it")
            for event in self._read_events(stream, buffer, 0.0):
                self.events.append(event)
            if store is not None:
                store.close()

    def _say(self, style: str, text: str) -> None:
        """One line on the console in ``style``; the text (a role's log, an error) is never read as markup."""
        self.console.print(f"[{style}]{escape(text)}[/{style}]", highlight=False)

    def _show_errors(self) -> None:
        """A role's ERROR log lines on the console as they come (a failing checkpoint disk, a restore that
        failed), the first few of each role; the rest stay in its log."""
        if self.quiet:
            return
        for child in self.children:
            if child.is_worker and self.command:  # a script's output reaches the console already
                continue
            for line in child.new_errors():
                child.errors_shown += 1
                if child.errors_shown <= ERRORS_SHOWN:
                    message = line.split(" ERROR ", 1)[1].split(": ", 1)[-1]  # without time, level and logger
                    self._say("red", f"{child.role}: {message}")
                elif child.errors_shown == ERRORS_SHOWN + 1:
                    self._say("red", f"{child.role}: more errors in {child.log_path}")

    # -- the run ----------------------------------------------------------------------
    def run(self) -> int:
        if not self.config.redis_url:
            find_redis_server()  # none to be had: said before the run leaves anything behind
        self.log_dir.mkdir(parents=True, exist_ok=True)
        started = time.monotonic()
        previous = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
        read_fd, write_fd = os.pipe()
        try:
            redis_url = self.config.redis_url
            if not redis_url:
                self.redis = RedisServer()
                redis_url = self.redis.url
            if self.config.fresh:  # before any role writes a key of the run
                self._clear_job(redis_url)
            if not self.quiet:
                self.console.print(f"job {self.job}: {self.config.shards} shards, {self.config.workers} workers, "
                                   f"Redis {redacted(redis_url)}, logs in {self.log_dir}/")
                if self.command and not self._threads_chosen():
                    self.console.print(f"workers: OMP_NUM_THREADS={worker_threads(self.config.workers)} each (this "
                                       f"host's {os.cpu_count()} cores shared by {self.config.workers} workers; set "
                                       "OMP_NUM_THREADS to choose)")
            self._start_roles(redis_url, write_fd)
            if not self.hosts.reports_ports:  # fixed ports (the testbed): known now
                self._write_prometheus_config()
            self._supervise(read_fd, redis_url)
            if not self.workers_only and self.hosts.reports_ports:  # not the DDP baseline's workers, nor a
                self._check_done(redis_url)  # testbed's Redis, which only its namespaces reach by name
            self._collect_ports()  # a job too short for the loop to have seen them all
            self._finish_roles()
        except Interrupted as exc:
            self._say("yellow", f"{exc}: stopping every role")
            return 128 + exc.signum
        except IMergeError as exc:  # ChildFailed included
            self._say("red", f"job {self.job} failed: {exc}")
            return 1
        finally:
            if write_fd >= 0:
                os.close(write_fd)
            self._stop_all()
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        self._summarize(time.monotonic() - started)
        return 0

    def _clear_job(self, redis_url: str) -> None:
        from imerge.control.store import Store

        store = Store(redis_url, self.job)
        try:
            store.check_job(self.token, "--fresh (deleting its keys)")
            log.info("--fresh: deleted %d keys of job %s", store.clear_job(), self.job)
        finally:
            store.close()

    def _write_prometheus_config(self) -> None:
        """``prometheus.yml`` in the log folder: scrapes every role, with IMerge's recording rules (written whole,
        then renamed: a reader never sees half of it)."""
        if not self.metrics_targets:
            return
        path = self.log_dir / "prometheus.yml"
        temporary = path.with_name(".prometheus.yml.tmp")
        temporary.write_text(prometheus_config(dict(sorted(self.metrics_targets.items(), key=_role_order)),
                                               self.job, rules_file()))
        os.replace(temporary, path)
        if not self.quiet:
            self.console.print(f"metrics: {', '.join(f'{r} {a}' for r, a in self.metrics_targets.items())}; "
                               f"Prometheus configuration in {path}")

    def _on_signal(self, signum: int, _frame: Any) -> None:
        raise Interrupted(signum)

    def _finish_roles(self) -> None:
        """After the workers: the coordinator exits by itself; shards are stopped gracefully."""
        coordinator = next((c for c in self.children if c.role == "coordinator"), None)
        if coordinator is None:
            return
        try:
            coordinator.process.wait(self.config.stop_grace_s)
        except Exception:  # noqa: BLE001 - stopped below either way
            log.warning("the coordinator did not exit after the workers finished")
        shards = [child for child in self.children if child.shard is not None]
        codes = proc.stop_all([child.process for child in shards], self.config.stop_grace_s)
        for child, code in zip(shards, codes):
            if code not in (0, -signal.SIGTERM):
                raise ChildFailed(child.role, f"exited with code {code} on SIGTERM")

    def _summarize(self, wall_s: float) -> None:
        iterations = [e for e in self.events if e.get("event") == "iteration"]
        times = [e["seconds"] for e in iterations if "seconds" in e]
        steady = times[1:] or times
        final: dict[str, Any] = next((e for e in reversed(self.events) if e.get("event") == "summary"), {})
        last = iterations[-1] if iterations else {}  # after a recovery, the iterations redone are reported again
        self.summary = {"job": self.job, "workers": self.config.workers, "shards": self.config.shards,
                        "iterations": final.get("iterations", last.get("iteration", len(iterations))),
                        "wall_seconds": round(wall_s, 3),
                        "median_iteration_seconds": statistics.median(steady) if steady else None,
                        "mean_iteration_seconds": statistics.fmean(steady) if steady else None,
                        "final_loss": final.get("loss", last.get("loss")), "test_accuracy": final.get("test_accuracy"),
                        "restarts": sum(child.restarts for child in self.children),
                        "log_dir": str(self.log_dir)}
        if self.config.summary_json:
            Path(self.config.summary_json).write_text(json.dumps(self.summary, indent=2))
        if self.quiet:
            return
        table = Table(title=f"job {self.job} finished")
        table.add_column("figure")
        table.add_column("value", justify="right")
        for key, value in self.summary.items():
            table.add_row(key, f"{value:.4f}" if isinstance(value, float) else str(value))
        Console().print(table)


def schedule_line(event: dict[str, Any]) -> str:
    """Worker 0's report of the schedule --tune chose, as one console line."""
    from imerge.core.knobs import describe

    retuned = int(event.get("plan") or 0) > 2  # plans v3 on: online re-tuning switched (the runner-up: the old one)
    line = (f"schedule {'re-tuned' if retuned else 'chosen'} by --tune from iteration {event.get('iteration', '?')}: "
            f"{describe(dict(event.get('knobs') or {}))}, predicted {_figure(event, 'predicted_s', 3)} s/it")
    if event.get("runner_up_s"):
        line += (f"; {'was' if retuned else 'runner-up'} {describe(dict(event.get('runner_up') or {}))}, "
                 f"{_figure(event, 'runner_up_s', 3)} s/it{' under the new measurements' if retuned else ''}")
    return line
