"""The suite's own setup (tests/conftest.py): what keeps its two pytest-xdist workers from running e2e tests side
by side."""
from __future__ import annotations

import importlib.metadata
import types

import pytest

import conftest


def options(dist: str) -> types.SimpleNamespace:
    return types.SimpleNamespace(getoption=lambda name, default=None: {"dist": dist}.get(name, default))


def test_a_pytest_that_loses_the_workers_groups_is_refused_naming_the_fix(monkeypatch):
    """pytest 9.2 with pytest-xdist 3.8 runs --dist loadgroup without its groups (pytest-dev/pytest-xdist#1386):
    refused, naming the pin; an older pytest, a newer xdist, or one process (-n 0: dist "no") runs."""
    versions = {"pytest": "9.2.0.dev340+g6a0de9be5", "pytest-xdist": "3.8.0"}
    monkeypatch.setattr(importlib.metadata, "version", lambda package: versions[package])
    with pytest.raises(pytest.UsageError, match=r"install 'pytest<9.2'.*or run .* with -n 0"):
        conftest._refuse_lost_groups(options("loadgroup"))
    conftest._refuse_lost_groups(options("no"))
    versions["pytest"] = "9.1.1"
    conftest._refuse_lost_groups(options("loadgroup"))
    versions.update({"pytest": "9.2.0", "pytest-xdist": "3.9.0"})
    conftest._refuse_lost_groups(options("loadgroup"))


def test_this_run_keeps_the_e2e_tests_in_one_group(request):
    """Where this run distributes by group, the e2e tests carry the group in their node ids (what pytest-xdist
    schedules by), which pytest 9.2 silently dropped."""
    if not getattr(request.config.option, "loadgroup", False):  # set in a pytest-xdist worker under loadgroup
        pytest.skip("not distributed by group (-n 0)")
    e2e = [item for item in request.session.items if item.get_closest_marker("e2e")]
    if not e2e:
        pytest.skip("no e2e test selected")
    assert all(item.nodeid.endswith("@e2e") for item in e2e), [i.nodeid for i in e2e[:3]]
