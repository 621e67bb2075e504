"""Which worker a client certificate speaks for. Pure.

With mutual TLS a shard knows the name in each client's certificate. A
worker's certificate names its rank: a DNS subject alternative name or the
common name ``worker-<rank>``, alone or as the first label of a longer name
(``worker-3.imerge.svc``). In strict mode (``--tls-worker-identity``) a shard
refuses a push or a pull that names another worker id, and an Import or Export
(the whole state of blocks, moved by ``imerge.load`` and ``imerge.save``) from
any certificate but worker 0's or an operator's (``imerge-operator``).
"""
from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

_WORKER = re.compile(r"worker-(\d+)(?:\.|$)")
_OPERATOR = re.compile(r"imerge-operator(?:\.|$)")


def worker_ranks(names: Iterable[str]) -> set[int]:
    """The worker ranks the certificate names stand for."""
    return {int(match.group(1)) for name in names if (match := _WORKER.match(name))}


def require_worker(names: Iterable[str], worker: int, what: str) -> None:
    """Strict worker identity: refuse ``worker`` unless the client's certificate names it."""
    from imerge.core.errors import PermissionDenied
    from imerge.core.limits import clip

    names = list(names)
    if worker not in worker_ranks(names):
        raise PermissionDenied(f"{what}: names worker {worker}, but the client's certificate names "
                               f"{clip(', '.join(names) or 'nothing', 200)} (--tls-worker-identity)")


def require_loader(names: Iterable[str], what: str) -> None:
    """Strict worker identity: only worker 0 (the one that runs imerge.load and imerge.save) or an operator's
    certificate (``imerge-operator``, alone or as the first label) moves whole states."""
    from imerge.core.errors import PermissionDenied
    from imerge.core.limits import clip

    names = list(names)
    if 0 not in worker_ranks(names) and not any(_OPERATOR.match(name) for name in names):
        raise PermissionDenied(f"{what}: only worker 0 (or an imerge-operator certificate) loads and saves the job's "
                               f"state, but the client's certificate names {clip(', '.join(names) or 'nothing', 200)} "
                               "(--tls-worker-identity)")


def certificate_names(peer: dict[str, Any] | None) -> list[str]:
    """The DNS names and common names of a certificate as Python's ``ssl`` gives it (``getpeercert()``)."""
    if not peer:
        return []
    names = [value for kind, value in peer.get("subjectAltName", ()) if kind == "DNS"]
    names += [value for rdn in peer.get("subject", ()) for key, value in rdn if key == "commonName"]
    return names
