"""The control plane's store: the only package in IMerge that issues Redis commands.

Every role reaches Redis through its facet of the store, whose methods are
named for what they mean and take and return the typed messages of
:mod:`imerge.control.messages`; no key or event name appears outside this
package. A facet holds what every role may read or report
(:class:`~.base.StoreBase`) and its own role's writes, as ``ROLE_WRITES``
gives them to its Redis ACL user: a shard's :class:`ShardStore` has no method
that writes a worker's keys, and a worker's :class:`WorkerStore` none that
writes the plan. :class:`Store` has every facet, for the launcher, the admin
tools and the tests.
Redis failures are translated into :class:`StoreError` here, at one choke
point. Blocking waits use blocking list pops (never loops of GETs), are cut in
slices of at most ``_BLOCK_SLICE_S`` seconds so that a dead Redis is noticed,
and end with :class:`WaitTimeout` naming what they waited for.

Key layout (all under ``imerge:{job}:``):

==========================  =======  ==============================================
key                         type     meaning
==========================  =======  ==============================================
``shards``                  hash     shard index -> advertised gRPC address
``shards:queue``            list     shard indexes, pushed on each registration
``workers``                 hash     worker rank -> JSON {host, pid}
``worker:{rank}:lease``     string   the rank lease (:class:`RankLeaseValue`: "host:pid:nonce beats"), renewed by the
                                     holder's heartbeat
                                     (the beat counts renewals), expires after the heartbeat TTL
``worker:{rank}:beats``     list     one token pushed by each renewal of the lease (wakes a claimant)
``worker:{rank}:alive``     string   heartbeat: the generation the worker serves (-1 while joining),
                                     expires after the heartbeat TTL
``layout:{rank}``           string   the worker's model layout (JSON, see planning)
``layouts:queue``           list     ranks, pushed when a layout is submitted
``event:{name}``            list     a latch: holds one token once the event is set
``event:{name}:value``      string   the event's payload
``done:queue``              list     ranks, pushed when a worker finished its job
``done``                    hash     rank -> 1 once the worker finished (read by a restarted coordinator)
``loading``                 string   the generation worker 0 imports an imerge.load's state into, while it does
                                     (a shard accepts an Import only then); expires
``profile``                 string   worker 0's profile for ``--fusion cost`` (JSON)
``profile:queue``           list     a token, pushed when the profile is submitted
``plan:latest``             string   the newest published plan's version
``windows:queue``           list     :class:`Window`: worker 0's measurement of each ``--retune-window`` iterations
``worker:{rank}:polled``    string   the iteration at which the worker last read ``plan:latest`` (re-tuning)
``flag:{f}``                string   holder token of slot flag f (:class:`Flag`: ``{v}:{g}:{s}[:{lane}]``, plan
                                     v, group g or ``port``, shard s, lane when not 0), with the lease as its
                                     expiry; absent = free
``flag:{f}:wake``           list     one token pushed by each release, to wake a waiter
``flags:stats``             hash     granted / contended (granted after a wait) / expired
                                     (released after the lease had passed) flag counts
``generation``              string   the job generation (absent until the plan is published;
                                     its loss means Redis lost the job's state)
``finished``                string   when every worker had finished (epoch seconds): the job is over
``lease``                   string   JSON {token, holder}: the run that holds the job's name (:class:`JobLease`),
                                     renewed by its coordinator, expires after the coordinator's heartbeat TTL
``shard:{i}:alive``         string   a shard's heartbeat: the generation it serves; expires after its TTL
``checkpoints``             hash     shard index -> JSON list of its complete checkpoint rounds
``failures:queue``          list     JSON {generation, who, reason}: a process saw a peer fail
``worker:{rank}:generation`` string  the generation the worker last joined
``positions``               hash     worker rank -> JSON {iteration, generation}: data position
``buffers:{g}:{i}:{rank}``  string   the model buffers (:class:`ModuleState`) a worker published after iteration i
                                     of generation g (broadcast_buffers); expires
``buffers:{g}:{i}:{rank}:ready`` list  a latch: holds a token once those buffers are published; expires
``scalars:{g}:{r}:to:{s}``  list     :class:`PostedScalars` (shard, sum of squares, found inf): each shard's
                                     scalars of round r that shard s needs before it steps (clipping, loss
                                     scaling); expires
==========================  =======  ==============================================

Events in use: ``plan:{version}`` (:class:`PlanPublished`; version 1 is the
first plan, 2 the cost plan, 3 on the plans of online re-tuning, each with the
iteration every worker switches at), ``blocks-ready:{version}`` (:class:`BlocksReady`:
rank 0 created every block of that plan; ``blocks-ready:1`` means the job is
running), ``generation:{g}`` (:class:`GenerationEvent`: recover from the
checkpoint of its round), ``restored:{g}:{shard}`` (:class:`Restored`) and
``loaded:{g}:{n}`` (:class:`Loaded`: worker 0 imported the n-th imerge.load).

Slot flags are leases: taking one is one Lua call (set the holder with an
expiry if absent); a worker that finds it taken blocks on the wake list with
BLPOP for at most the holder's remaining lease, then tries again, so a dead
holder frees the flag when its lease expires and nobody polls. Releasing is a
Lua compare-and-delete on the holder token, so a late release by an old
holder never frees a newer holder's flag.
A re-tuned plan is published by a Lua script only while no worker has read
``plan:latest`` at or past the window boundary before its switch (each worker
records its boundary and reads the version in one MULTI), so every worker sees
it in time and all switch at the same iteration.
A latch is waited on with BLPOP and the token is pushed back at once, so any
number of waiters see it, now or later.
"""
from __future__ import annotations

from .base import ACL_MIN_REDIS, FLAG_STATS, ROLE_COMMANDS, ROLE_WRITES, StoreBase
from .coordinator import CoordinatorStore
from .shard import ShardStore
from .worker import WorkerStore

__all__ = ["ACL_MIN_REDIS", "FLAG_STATS", "ROLE_COMMANDS", "ROLE_WRITES", "CoordinatorStore", "ShardStore", "Store",
           "StoreBase", "WorkerStore"]


class Store(WorkerStore, ShardStore, CoordinatorStore):
    """Every facet: the launcher, the admin tools and the tests (a role's process uses its own facet)."""
