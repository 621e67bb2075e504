"""Which worker a client certificate speaks for. Pure.

With mutual TLS a shard knows the name in each client's certificate. A
worker's certificate names its rank: a DNS subject alternative name or the
common name ``worker-<rank>``, alone or as the first label of a longer name
(``worker-3.imerge.svc``). In strict mode (``--tls-worker-identity``) a shard
refuses a push or a pull that names another worker id.
"""
from __future__ import annotations

import re
from collections.abc import Iterable

_WORKER = re.compile(r"worker-(\d+)(?:\.|$)")


def worker_ranks(names: Iterable[str]) -> set[int]:
    """The worker ranks the certificate names stand for."""
    return {int(match.group(1)) for name in names if (match := _WORKER.match(name))}
