"""``imerge redis-acl``: create one Redis ACL user per role, allowed only its commands on one job's keys.

Passwords come only from the environment (``IMERGE_REDIS_PASSWORD_COORDINATOR``,
``_PS``, ``_WORKER``), never from flags or defaults. Each role then connects
with ``redis://imerge-ROLE:PASSWORD@host:port/db``.
"""
from __future__ import annotations

import dataclasses
import os

from imerge.core.config import option, redacted, require
from imerge.core.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class RedisAclConfig:
    admin_url: str = option("redis://127.0.0.1:6379/0", "an admin connection to Redis (user and password in "
                                                        "the URL)")
    job: str = option("default", "the job whose keys (imerge:JOB:*) the users may touch")
    roles: str = option("coordinator,ps,worker", "comma-separated roles to create users for")

    def __post_init__(self) -> None:
        require(self.admin_url.startswith(("redis://", "rediss://", "unix://")), "admin_url",
                "expected redis://user:password@host:port/db")
        require(bool(self.job) and ":" not in self.job, "job", "must be non-empty without ':'")


def password_variable(role: str) -> str:
    return f"IMERGE_REDIS_PASSWORD_{role.upper()}"


def run_redis_acl(config: RedisAclConfig) -> str:
    from imerge.control.store import ROLE_COMMANDS, Store

    roles = [r.strip() for r in config.roles.split(",") if r.strip()]
    unknown = [r for r in roles if r not in ROLE_COMMANDS]
    require(not unknown, "roles", f"unknown roles {unknown}; choose from {', '.join(ROLE_COMMANDS)}")
    passwords = {}
    for role in roles:
        password = os.environ.get(password_variable(role), "")
        if len(password) < 12:
            raise ConfigError(password_variable(role), "must hold the role's password (12 characters or more)")
        passwords[role] = password
    store = Store(config.admin_url, config.job)
    try:
        users = store.create_role_users(passwords)
    finally:
        store.close()
    return f"created {', '.join(users)} on {redacted(config.admin_url)} for job {config.job}"
