"""The ``imerge`` command: one subcommand per role, plus the one-host launcher.

Every option is a flag with an ``IMERGE_*`` environment twin (see
:mod:`imerge.core.config`); a bad value is a usage error naming the flag.
"""
from __future__ import annotations

import argparse
import asyncio
import importlib
import dataclasses
import faulthandler
import logging
import os
import shutil
import signal
import sys
from collections.abc import Callable
from typing import Any, NoReturn

from imerge.core.config import (LAUNCH_FLAGS_ENV, add_options, env_name, explicit_fields, flag_name, from_namespace,
                                given_options, setup_logging, to_env)
from imerge.core.errors import EXIT_FATAL, EXIT_REJOIN, ConfigError, IMergeError, Rejoin
from imerge.ops import commandline

log = logging.getLogger("imerge.cli")


def _run_ps(args: argparse.Namespace) -> int:
    from imerge.ps.config import PSConfig
    from imerge.ps.server import serve

    config = from_namespace(PSConfig, args)
    setup_logging(config.log_level, f"ps{config.shard_index}")
    return asyncio.run(serve(config))


def _run_coordinator(args: argparse.Namespace) -> int:
    from imerge.coordinator.service import Coordinator, CoordinatorConfig

    config = from_namespace(CoordinatorConfig, args)
    setup_logging(config.log_level, "coordinator")
    coordinator = Coordinator(config)

    def on_sigterm(*_: Any) -> None:  # it holds nothing to drain: leave at once, even from a blocking wait
        coordinator.stop()
        raise SystemExit(128 + signal.SIGTERM)

    signal.signal(signal.SIGTERM, on_sigterm)
    return coordinator.run()


def _run_worker(args: argparse.Namespace) -> int:
    from imerge.worker.config import ScheduleConfig, WorkerConfig
    from imerge.worker.job import run_job
    from imerge.workloads.job import JobConfig

    worker, job = from_namespace(WorkerConfig, args), from_namespace(JobConfig, args)
    worker = worker.tuned(explicit_fields(ScheduleConfig, args.given))  # --tune auto: the knobs no option gives
    if worker.nproc_per_node > 1 or args.command:  # a node's processes, or a script run as this worker
        from imerge.ops.node import run_node

        setup_logging(worker.log_level, f"node{worker.node_rank if worker.node_rank >= 0 else worker.rank}")
        return run_node(worker, job, args.command)
    setup_logging(worker.log_level, f"worker{worker.rank}")

    def preempted(signum: int, _frame: object) -> None:  # leave at once; the job recovers and this rank rejoins
        raise Rejoin(f"worker {worker.rank}: {signal.Signals(signum).name} (preempted)")

    signal.signal(signal.SIGTERM, preempted)
    try:
        summary = run_job(worker, job)
    except Rejoin as exc:
        log.warning("%s", exc)
        return EXIT_REJOIN
    except IMergeError as exc:  # fatal: restarting this worker would fail the same way
        if exc.recoverable:
            raise
        log.error("%s: %s; the job cannot go on (exit code %d: do not restart)", type(exc).__name__, exc,
                  EXIT_FATAL)
        return EXIT_FATAL
    log.info("done: %s", summary)
    return 0


def _run_launch(args: argparse.Namespace) -> int:
    from imerge.ops.launch import LaunchConfig, Launcher
    from imerge.worker.config import ScheduleConfig
    from imerge.workloads.job import JobConfig

    config, job = from_namespace(LaunchConfig, args), from_namespace(JobConfig, args)
    schedule = from_namespace(ScheduleConfig, args).tuned(explicit_fields(ScheduleConfig, args.given))
    logging.basicConfig(level=logging.WARNING, format="imerge launch: %(message)s")
    return Launcher(config, job_env(job, args), args.command, schedule_env=to_env(schedule), save_state=True).run()


def job_env(job: Any, args: argparse.Namespace) -> dict[str, str]:
    """The built-in job's variables; with a script, only the optimizer flags given, which the script's
    ``imerge.distribute`` must honour (``IMERGE_LAUNCH_FLAGS`` lists every flag given, to check that):
    the built-in job's other flags mean nothing to a script and are refused."""
    from imerge.workloads.job import OPTIMIZER_FIELDS

    if not args.command:
        return to_env(job)
    stray = sorted(args.given & {f.name for f in dataclasses.fields(job)} - set(OPTIMIZER_FIELDS))
    if stray:
        raise ConfigError(flag_name(stray[0]), "is an option of the built-in job; a script after -- builds its own "
                                               "model, data and loop (drop the flag, or read it in the script)")
    env = {name: value for name, value in to_env(job).items()
           if name in {env_name(field) for field in args.given & set(OPTIMIZER_FIELDS)}}
    env[LAUNCH_FLAGS_ENV] = ",".join(sorted(args.given))
    return env


def _run_testbed(args: argparse.Namespace) -> int:
    from imerge.ops.launch import LaunchConfig, Launcher, TestbedHosts
    from imerge.bench.testbed import Testbed, TestbedConfig, job_roles, reap_stale, start_redis
    from imerge.worker.config import ScheduleConfig
    from imerge.workloads.job import JobConfig

    testbed = from_namespace(TestbedConfig, args)
    logging.basicConfig(level=logging.WARNING, format="imerge testbed: %(message)s")
    if testbed.cleanup:
        removed = reap_stale()
        print(f"removed {len(removed)} namespaces left by dead testbed runs: {' '.join(removed) or '-'}")
        return 0
    config, job = from_namespace(LaunchConfig, args), from_namespace(JobConfig, args)
    schedule = from_namespace(ScheduleConfig, args).tuned(explicit_fields(ScheduleConfig, args.given))
    with Testbed(testbed.links(job_roles(config.shards, config.workers)), testbed.subnet,
                 mtu=testbed.mtu, tcp_congestion=testbed.tcp_congestion) as bed:
        redis_url = start_redis(bed)
        config = dataclasses.replace(config, redis_url=redis_url)
        return Launcher(config, job_env(job, args), args.command, schedule_env=to_env(schedule),
                        hosts=TestbedHosts(bed), save_state=True).run()


def _run_bench(args: argparse.Namespace) -> int:
    from rich.console import Console

    from imerge.bench.runner import BenchConfig, run_bench

    config = from_namespace(BenchConfig, args)
    logging.basicConfig(level=logging.WARNING, format="imerge bench: %(message)s")
    if args.scenario == "compression":  # CPU only
        from imerge.bench.compression_cost import compression_markdown, run_compression_cost

        workers = config.workers or 3
        print(compression_markdown(run_compression_cost(workers=workers, iters=config.iters or 5,
                                                        rate_mbit=config.rate_mbit or 1000.0)))
        return 0
    if args.scenario == "datapath":  # on loopback: no testbed, no root
        from imerge.bench.datapath import run_datapath
        from imerge.bench.report import datapath_markdown

        print(datapath_markdown(run_datapath(config, Console(stderr=True))))
        return 0
    from imerge.bench.report import markdown
    from imerge.sim.plots import pyplot

    pyplot(f"imerge bench {args.scenario}")  # the report's figures: a missing matplotlib is said before the runs
    report = run_bench(args.scenario, config, Console(stderr=True))

    print(markdown(report))
    return 0


def _run_simulate(args: argparse.Namespace) -> int:
    from imerge.core.schedule_config import ScheduleConfig
    from imerge.sim.commands import run_target
    from imerge.sim.runner import SimConfig

    config, base = from_namespace(SimConfig, args), from_namespace(ScheduleConfig, args)
    pinned = frozenset(explicit_fields(ScheduleConfig, args.given))
    print(run_target(args.target, config, base, lambda line: print(line, file=sys.stderr, flush=True), pinned))
    return 0


def _run_top(args: argparse.Namespace) -> int:
    from rich.console import Console

    from imerge.ops.top import TopConfig, run_top

    return run_top(from_namespace(TopConfig, args), Console())


def _run_health(args: argparse.Namespace) -> int:
    from imerge.ops.health import HealthConfig, run_health

    print(run_health(from_namespace(HealthConfig, args)))
    return 0


def _run_wind_down(args: argparse.Namespace) -> int:
    from imerge.ops.wind_down import WindDownConfig, run_wind_down

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s imerge wind-down: %(message)s")
    logging.getLogger("imerge").info("%s", run_wind_down(from_namespace(WindDownConfig, args)))
    return 0


def _run_redis_acl(args: argparse.Namespace) -> int:
    from imerge.ops.redis_acl import RedisAclConfig, run_redis_acl

    print(run_redis_acl(from_namespace(RedisAclConfig, args)))
    return 0


_LAUNCH = ("imerge.ops.launch:LaunchConfig", "imerge.workloads.job:JobConfig", "imerge.worker.config:ScheduleConfig")
ROLE_CONFIGS = {  # role -> the config classes its flags and IMERGE_* variables come from, "module:class"
    "ps": ("imerge.ps.config:PSConfig",),
    "coordinator": ("imerge.coordinator.service:CoordinatorConfig",),
    "worker": ("imerge.worker.config:WorkerConfig", "imerge.workloads.job:JobConfig"),
    "launch": _LAUNCH,
    "bench": ("imerge.bench.runner:BenchConfig",),
    "simulate": ("imerge.sim.runner:SimConfig", "imerge.core.schedule_config:ScheduleConfig"),
    "testbed": ("imerge.bench.testbed:TestbedConfig", *_LAUNCH),
    "top": ("imerge.ops.top:TopConfig",),
    "health": ("imerge.ops.health:HealthConfig",),
    "redis-acl": ("imerge.ops.redis_acl:RedisAclConfig",),
    "wind-down": ("imerge.ops.wind_down:WindDownConfig",),
}


def _configs(role: str) -> tuple[type, ...]:
    """The config classes of ``role``, imported only for that role (the coordinator, top, health and redis-acl
    start without torch)."""
    return tuple(getattr(importlib.import_module(module), name)
                 for module, name in (spec.split(":") for spec in ROLE_CONFIGS[role]))


Runner = Callable[[argparse.Namespace], int]  # a role's runner: the process's exit code
ROLES: dict[str, tuple[str, Runner]] = {  # role (subcommand) -> (its help, its runner)
    "ps": ("run one PS shard", _run_ps),
    "coordinator": ("run the coordinator", _run_coordinator),
    "worker": ("run one worker of the built-in job", _run_worker),
    "launch": ("run a whole job on this host (built-in job, or a script after --)", _run_launch),
    "bench": ("run every strategy on one scenario in the testbed and report it (root)", _run_bench),
    "simulate": ("simulate a job's schedule on a cluster of any size, with the product's own policies", _run_simulate),
    "testbed": ("run a whole job in an emulated cluster: one network namespace per role, links shaped with tc "
                "tbf (root)", _run_testbed),
    "top": ("a live terminal view of a running job, from its /metrics endpoints", _run_top),
    "health": ("exit 0 if a shard's gRPC health service says SERVING (or a role's /metrics answers)", _run_health),
    "redis-acl": ("create one Redis ACL user per role (passwords from IMERGE_REDIS_PASSWORD_<ROLE>)",
                  _run_redis_acl),
    "wind-down": ("in a chart release without JobSet: once the job's Jobs finished, scale its shards' and Redis' "
                  "StatefulSets to zero", _run_wind_down),
}


def role_specs() -> dict[str, tuple[str, tuple[type, ...], Runner]]:
    """Each role (subcommand): its help, the config classes its flags and IMERGE_* variables come from, its runner."""
    return {role: (help_text, _configs(role), runner) for role, (help_text, runner) in ROLES.items()}


EXAMPLES = {
    "launch": ["imerge launch --shards 2 --workers 2 --model digits-cnn --data digits --epochs 10",
               "imerge launch --shards 2 --workers 4 --compression fp16 -- python train.py --epochs 3",
               "imerge launch --resume runs/JOB"],
    "worker": ["IMERGE_RANK=0 IMERGE_WORLD_SIZE=2 IMERGE_REDIS_URL=redis://host:6379/0 imerge worker --model resnet18",
               "imerge worker --nproc-per-node 8 --node-rank 1 --world-size 16 --device cuda"],
    "ps": ["imerge ps --shard-index 0 --host 0.0.0.0 --port 50051 --advertise ps0.example:50051 "
           "--redis-url redis://host:6379/0"],
    "coordinator": ["imerge coordinator --num-shards 2 --num-workers 4 --redis-url redis://host:6379/0"],
    "bench": ["imerge bench B2 --rate-mbit 100 --rounds 2 --strategies ddp,imerge,imerge-fp16",
              "imerge bench datapath --rounds 2", "imerge bench compression"],
    "simulate": ["imerge simulate --model resnet50-like --workers 1024 --shards 256 --link-gbit 25",
                 "imerge simulate --profile runs/JOB/profile.json --workers 64 --strategies ddp,imerge",
                 "imerge simulate B2 --measured runs/bench-B2/results.json",
                 "imerge simulate calibrate --runs runs/bench-B4/results.json,runs/bench-B3/results.json",
                 "imerge simulate projections --out docs/img/scaling"],
    "testbed": ["imerge testbed --shards 3 --workers 3 --rate-mbit 1000 --model vgg --iters 50",
                "imerge testbed --cleanup"],
    "top": ["imerge top --prometheus-config runs/JOB/prometheus.yml", "imerge top --targets 127.0.0.1:9400 --once"],
    "health": ["imerge health --address 127.0.0.1:50051", "imerge health --http-address 127.0.0.1:9400"],
    "redis-acl": ["IMERGE_REDIS_PASSWORD_PS=... imerge redis-acl --admin-url redis://default:admin@host:6379/0"],
    "wind-down": ["imerge wind-down --jobs train-imerge-worker,train-imerge-coordinator "
                  "--statefulsets train-imerge-ps,train-imerge-redis"],
}


class OneLineParser(argparse.ArgumentParser):
    """argparse, whose mistakes (an unknown flag, a value not among the choices) are one line, not a page of
    usage before it; a flag is taken only as spelled in full (``--worker 2`` is not ``--workers 2``)."""

    def __init__(self, *args: Any, **kwargs: Any):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:  # noqa: D102 - argparse's
        self.exit(2, f"{self.prog}: error: {message} (--help lists the options)\n")


def version_line() -> str:
    """``imerge --version``: IMerge's release and the torch it runs on (read without importing torch)."""
    from imerge.telemetry.metrics import build_versions

    versions = build_versions()
    return f"imerge {versions['version']} (torch {versions['torch_version']}, Python {sys.version.split()[0]})"


def build_parser(only: str | None = None) -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The command line; with ``only``, the other roles' options are left out (they are listed by name)."""
    parser = OneLineParser(prog="imerge", description="IMerge: communication-scheduled PS training")
    parser.add_argument("--version", action="version", version=version_line())
    roles = parser.add_subparsers(dest="role", required=True, metavar="ROLE", parser_class=OneLineParser)
    subparsers: dict[str, argparse.ArgumentParser] = {}
    for name, (help_text, runner) in ROLES.items():
        configs = _configs(name) if only in (None, name) else ()
        examples = "\n".join(f"  {line}" for line in EXAMPLES.get(name, []))
        sub = roles.add_parser(name, help=help_text, description=help_text,
                               epilog=f"examples:\n{examples}" if examples else None,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
        for config in configs:
            add_options(sub, config)
        sub.set_defaults(run=runner, command=[])
        if name == "bench":
            sub.add_argument("scenario", help="B1, B2, B3 (incast), B4 (scaling over --sizes), tiny, datapath (PS "
                                              "against DDP on loopback: s/it, GB/s and CPU s/GB per process), or "
                                              "compression (the CPU each --compression mode costs on ResNet-18's "
                                              "gradient, against the link time it saves at --rate-mbit)")
        if name == "simulate":
            sub.add_argument("target", nargs="?", default="job",
                             help="job (the cluster of the flags; default), B1, B2, B3, B4 (a benchmark scenario on the "
                                  "testbed, beside --measured), projections (the scaling study of docs/scaling.md), "
                                  "calibrate (fit the constants to --runs)")
        subparsers[name] = sub
    return parser, subparsers


def _usage_error(role: str, message: str) -> int:
    """A mistake on the command line: one line naming it, exit code 2 (as argparse's own errors)."""
    print(f"imerge {role}: error: {message}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command: list[str] = []
    split_given = "--" in argv
    if split_given:
        split = argv.index("--")
        argv, command = argv[:split], commandline.own_python(argv[split + 1:])
    if argv and argv[0] in ("launch", "testbed", "bench", "worker", "ps"):  # IMerge's processes: never compile
        from imerge.core.optim import check_without_dynamo

        check_without_dynamo()
    try:
        parser, subparsers = build_parser(argv[0] if argv and argv[0] in ROLES else "")
    except ConfigError as exc:  # a bad IMERGE_* value while building the defaults
        print(f"imerge: error: {exc}", file=sys.stderr)
        return 2
    role = argv[0] if argv and argv[0] in subparsers else ""
    if role:
        known = [flag for action in subparsers[role]._actions for flag in action.option_strings]
        argv = [role, *commandline.dashed(argv[1:], known)]  # torchrun's --nproc_per_node: our --nproc-per-node
        if why := commandline.torchrun_only(argv[1:], known):
            return _usage_error(role, why)
    args, extras = parser.parse_known_args(argv)
    if extras:
        if why := commandline.without_separator(args.role, argv, extras):
            return _usage_error(args.role, why)
        subparsers[args.role].error(f"unrecognized arguments: {' '.join(extras)}")
    if command and args.role not in ("launch", "testbed", "worker"):
        return _usage_error(args.role, "a command after -- is only accepted by 'imerge launch', 'imerge testbed' "
                                       "and 'imerge worker'")
    if split_given and not command:
        return _usage_error(args.role, "-- is followed by no command: give the script to run after it (python "
                                       "train.py ...), or leave -- out to run the built-in job")
    if command and not _runnable(command[0]):
        return _usage_error(args.role, f"no such command: {command[0]} (the command after --: a program on PATH "
                                       "or the path of an executable file)")
    args.command = command
    args.given = given_options(argv[argv.index(args.role) + 1:], *_configs(args.role))
    run: Runner = args.run
    try:
        return run(args)
    except ConfigError as exc:  # one line naming the option (a bad value, a port that cannot be bound)
        return _usage_error(args.role, str(exc))
    except IMergeError as exc:
        if logging.getLogger().handlers:  # a role that logs: one line, in its log format
            logging.getLogger("imerge").error("%s", exc)
        else:
            print(f"imerge {args.role}: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


def _runnable(program: str) -> bool:
    return shutil.which(program) is not None


def run() -> None:
    """The command's entry point: :func:`main`, then leave without tearing the interpreter down. With torch loaded
    that takes most of a second per process, and by then every role has joined its threads and closed its
    files; only the logs and the standard streams are flushed first. ``kill -USR1`` makes any IMerge process
    print every thread's stack to its standard error (its log) and go on: what a stuck one waits for."""
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    code = main()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code)


if __name__ == "__main__":
    run()
