"""Frozen configuration dataclasses built from CLI flags and ``IMERGE_*`` twins.

Each role has one frozen dataclass. Every field becomes a flag ``--field-name``
whose default comes from the environment variable ``IMERGE_FIELD_NAME`` (and
optional aliases such as ``RANK`` for torchrun), else from the field default.
Invalid values raise :class:`ConfigError` naming the flag, which the CLI turns
into a usage error.
"""
from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import re
import typing
from pathlib import Path
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

from imerge.core.errors import ConfigError
from imerge.core.scheduling import THREAD_POLICIES

C = TypeVar("C", bound="DataclassInstance")
LAUNCH_FLAGS_ENV = "IMERGE_LAUNCH_FLAGS"  # the fields whose flags ``imerge launch`` was given with a script
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}
DEFAULT_LINK_MBPS = 10000.0  # --link-mbps: a 10 Gbit/s link


def option(default: Any, help: str, *, choices: tuple[str, ...] | None = None,
           aliases: tuple[str, ...] = ()) -> Any:
    """A config field: its default, its help text, allowed values, env aliases."""
    return dataclasses.field(default=default, metadata={
        "help": help, "choices": choices, "aliases": aliases})


def flag_name(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


def env_name(field_name: str) -> str:
    return "IMERGE_" + field_name.upper()


def _field_types(cls: type) -> dict[str, type]:
    return typing.get_type_hints(cls)


def parse_value(kind: type, raw: str, source: str) -> Any:
    """Parse a string from the environment into ``kind``; errors name ``source``."""
    text = raw.strip()
    try:
        if kind is bool:
            if text.lower() in _TRUE:
                return True
            if text.lower() in _FALSE:
                return False
            raise ValueError
        return kind(text)
    except ValueError:
        raise ConfigError(source, f"expected {kind.__name__}, got {raw!r}") from None


def _env_value(field: dataclasses.Field[Any], kind: type, env: Mapping[str, str]) -> Any:
    for name in (env_name(field.name), *field.metadata.get("aliases", ())):
        if env.get(name, "") != "":
            return parse_value(kind, env[name], f"{name} (environment twin of {flag_name(field.name)})")
    return field.default


def add_options(parser: argparse.ArgumentParser, cls: type, env: Mapping[str, str] | None = None,
                suppress_defaults: bool = False) -> None:
    """Add one flag per field of ``cls``; defaults come from the environment (``suppress_defaults``: none, so a
    parse lists only the flags given)."""
    env = os.environ if env is None else env
    types = _field_types(cls)
    groups: dict[str, Any] = {}
    for field in dataclasses.fields(cls):
        kind = types[field.name]
        default = argparse.SUPPRESS if suppress_defaults else _env_value(field, kind, env)
        help_text = f"{field.metadata.get('help', '')} [env {env_name(field.name)}; default: {default!r}]"
        title = GROUP_TITLES.get(_declared_by(cls, field.name).__name__, "options")
        group = groups.get(title) or groups.setdefault(title, parser.add_argument_group(title))
        if kind is bool:
            group.add_argument(flag_name(field.name), dest=field.name, default=default,
                               action=argparse.BooleanOptionalAction, help=help_text)
        else:
            group.add_argument(flag_name(field.name), dest=field.name, default=default, type=kind,
                               choices=field.metadata.get("choices"), help=help_text)


# --help groups a role's flags by the config class that declares them
GROUP_TITLES = {"CommonConfig": "job, Redis, logging and metrics", "TlsConfig": "TLS of the gRPC channels",
                "ScheduleConfig": "scheduling and compression", "JobConfig": "the built-in job",
                "LaunchConfig": "the processes on this host", "TestbedConfig": "the emulated network",
                "WorkerConfig": "this worker", "PSConfig": "this shard", "CoordinatorConfig": "the coordinator",
                "BenchConfig": "the benchmark", "TopConfig": "the view", "HealthConfig": "the check",
                "RedisAclConfig": "the ACL users"}


def _declared_by(cls: type, name: str) -> type:
    """The class of ``cls``'s hierarchy whose own annotations declare field ``name``."""
    return next((klass for klass in cls.__mro__ if name in getattr(klass, "__annotations__", {})), cls)


def given_options(argv: list[str], *classes: type) -> set[str]:
    """The fields of ``classes`` whose flags ``argv`` gives explicitly (not from a default or the environment)."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    for cls in classes:
        add_options(parser, cls, suppress_defaults=True)
    return set(vars(parser.parse_known_args(argv)[0]))


def explicit_fields(cls: type, given: set[str] | frozenset[str] = frozenset(),
                    env: Mapping[str, str] | None = None) -> set[str]:
    """The fields of ``cls`` given explicitly: by a flag or keyword (``given``) or by a set IMERGE_* variable."""
    env = os.environ if env is None else env
    in_env = {field.name for field in dataclasses.fields(cls)
              if any(env.get(name, "") != "" for name in (env_name(field.name), *field.metadata.get("aliases", ())))}
    return (set(given) & {field.name for field in dataclasses.fields(cls)}) | in_env


def from_namespace(cls: type[C], namespace: argparse.Namespace) -> C:
    return cls(**{f.name: getattr(namespace, f.name) for f in dataclasses.fields(cls)})


def from_env(cls: type[C], env: Mapping[str, str] | None = None, **overrides: Any) -> C:
    """Build ``cls`` from the environment; keyword overrides win."""
    env = os.environ if env is None else env
    types = _field_types(cls)
    values = {f.name: _env_value(f, types[f.name], env) for f in dataclasses.fields(cls)}
    unknown = set(overrides) - set(values)
    if unknown:
        raise ConfigError(", ".join(sorted(unknown)), f"not an option of {cls.__name__}")
    values.update(overrides)
    return cls(**values)


def to_env(config: Any) -> dict[str, str]:
    """The ``IMERGE_*`` variables that rebuild ``config`` in a child process."""
    env = {}
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        env[env_name(field.name)] = ("1" if value else "0") if isinstance(value, bool) else str(value)
    return env


def require(condition: bool, field_name: str, message: str) -> None:
    """Raise ConfigError naming the flag of ``field_name`` unless ``condition``."""
    if not condition:
        raise ConfigError(flag_name(field_name), message)


def check_choices(config: Any) -> None:
    """Validate every field that declares choices (for configs not built by argparse)."""
    for field in dataclasses.fields(config):
        choices = field.metadata.get("choices")
        if choices and getattr(config, field.name) not in choices:
            raise ConfigError(flag_name(field.name),
                              f"invalid choice {getattr(config, field.name)!r} (choose from {', '.join(choices)})")


@dataclasses.dataclass(frozen=True)
class CommonConfig:
    """Options every role shares."""

    job: str = option("default", "job id; every Redis key lives under imerge:{job}:")
    redis_url: str = option("redis://127.0.0.1:6379/0", "Redis URL of the coordinator's store")
    log_level: str = option("INFO", "logging level",
                            choices=("DEBUG", "INFO", "WARNING", "ERROR"))
    wait_timeout_s: float = option(120.0, "timeout of every wait for another role (plan, registration)")
    metrics_port: int = option(0, "port of this process's Prometheus /metrics (0: any free port, printed at "
                                  "start; -1: off)")
    metrics_host: str = option("", "address /metrics listens on (empty: a shard's --host, 127.0.0.1 for the other "
                                   "roles; 0.0.0.0 where a Prometheus on another host scrapes it)")
    link_mbps: float = option(DEFAULT_LINK_MBPS, "capacity of this host's network link, Mbit/s (the denominator "
                                                 "of link utilization; a worker's sets the blocks' size where "
                                                 "--partition-mib is 0)")
    ports_file: str = option("", "once bound, write the ports this process listens on to this file (JSON: "
                                 "metrics, and a shard's grpc), so that whoever started it learns them: "
                                 "imerge launch binds every port 0")
    job_token: str = option("", "this run's token (imerge launch and the chart set one per run): a coordinator, "
                                "shard or worker refuses a job whose name another run's token holds (empty: the "
                                "coordinator makes one; shards and workers then check nothing)")

    def metrics_address(self, listen_host: str = "127.0.0.1") -> str:
        """Where /metrics listens: --metrics-host, else the role's own listen address (loopback by default)."""
        return self.metrics_host or listen_host

    def __post_init__(self) -> None:
        check_choices(self)
        require(-1 <= self.metrics_port < 65536, "metrics_port", "must be -1 (off), 0 (any free port) or a port")
        require(self.link_mbps > 0, "link_mbps", "must be positive")
        require(bool(self.job) and ":" not in self.job and " " not in self.job, "job",
                "must be non-empty without ':' or spaces")
        require(self.redis_url.startswith(("redis://", "rediss://", "unix://")), "redis_url",
                f"expected redis://host:port/db, got {self.redis_url!r}")
        require(self.wait_timeout_s > 0, "wait_timeout_s", "must be positive")


@dataclasses.dataclass(frozen=True)
class ThreadPolicyConfig:
    """The scheduling policy of a shard's or a worker's data-path threads (:mod:`imerge.core.scheduling`)."""

    thread_policy: str = option("batch", "Linux scheduling policy of the data path's threads (a shard's every "
                                         "thread, a worker's comm threads; the training thread keeps its own): "
                                         "batch (SCHED_BATCH: a woken thread does not preempt the one that woke "
                                         "it, which holds the interpreter lock: half the context switches) or "
                                         "normal (the system's default). A policy set with chrt is kept",
                                choices=THREAD_POLICIES)


@dataclasses.dataclass(frozen=True)
class TlsConfig:
    """TLS of the gRPC channels (shards, workers, the health check); plaintext when empty."""

    tls_cert: str = option("", "this role's TLS certificate chain (PEM); on a shard it turns TLS on")
    tls_key: str = option("", "the private key of --tls-cert (PEM)")
    tls_ca: str = option("", "CA certificates (PEM): a shard requires client certificates signed by them "
                             "(mutual TLS); a client verifies the shards against them")

    def __post_init__(self) -> None:
        require(bool(self.tls_cert) == bool(self.tls_key), "tls_key", "--tls-cert and --tls-key go together")
        for name in ("tls_cert", "tls_key", "tls_ca"):
            path = getattr(self, name)
            require(not path or Path(path).is_file(), name, f"no such file: {path}")

    @property
    def tls_server(self) -> bool:
        return bool(self.tls_cert)

    @property
    def tls_client(self) -> bool:
        return bool(self.tls_ca)


def redacted(url: str) -> str:
    """``url`` without its password, for messages and logs."""
    return re.sub(r"(//[^:/@]*:)[^@]*@", r"\1***@", url)


def setup_logging(level: str, role: str) -> None:
    logging.basicConfig(level=getattr(logging, level),
                        format=f"%(asctime)s {role} %(levelname)s %(name)s: %(message)s")
