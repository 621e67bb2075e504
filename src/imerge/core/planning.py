"""The plan: model layout, units and blocks, fusion groups, and placement on shards.

Pure policy: imports neither grpc nor redis.

* The **layout** lists the trainable parameters in backward order; the worker
  keeps all of them in one flat buffer in that order, so every unit, block and
  group below is a contiguous range of it.
* A **unit** is one module's parameters. A unit larger than the partition cap
  is split into near-equal **partitions**; each partition (or whole unit) is a
  **block**: the shard-side unit of aggregation and optimizer state, stable for
  the job.
* A **group** is a run of consecutive units that travel together (fusion);
  its phase under interleave period T is ``(-index) mod T`` (see schedule).
* **Placement** puts each block on a shard.
"""
from __future__ import annotations

import dataclasses
import heapq
import json
import math
import statistics
from collections.abc import Sequence
from typing import Any

from imerge.core.dtypes import BLOCK_DTYPE
from imerge.core.errors import LayoutMismatchError, PlanError
from imerge.core.knobs import JOB_KNOBS
from imerge.core.schedule import phase

FUSIONS = ("none", "size", "cost")
PLACEMENTS = ("lpt", "stripe", "round-robin")
BYTES_PER_ELEMENT = BLOCK_DTYPE.itemsize
FIRST_PLAN = 1  # the plan published once every worker submitted its layout
MANY_SHARDS = 8        # from this many shards on, lpt and round-robin cut a shard's even share of the model ...
BLOCKS_PER_SHARD = 16  # ... into at least this many blocks
MIN_BLOCK_BYTES = 2048  # ... but no block smaller than this (a tiny model on many shards stays unbalanced)
MIN_PIECE_BYTES = 1024  # placement stripe cuts no piece smaller than this off a unit
COST_PLAN = 2   # with --fusion cost or --tune: the blocks of the first plan, regrouped from worker 0's profile


@dataclasses.dataclass(frozen=True)
class ParamInfo:
    name: str
    shape: tuple[int, ...]
    module: str  # qualified name of the module that owns the parameter
    group: int = 0  # the optimizer parameter group it belongs to

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclasses.dataclass(frozen=True)
class Layout:
    """The trainable parameters of a model, in backward order (first ready first)."""

    params: tuple[ParamInfo, ...]

    def to_json(self) -> str:
        return json.dumps([[p.name, list(p.shape), p.module, p.group] for p in self.params])

    @classmethod
    def from_json(cls, text: str) -> "Layout":
        return cls(tuple(ParamInfo(entry[0], tuple(entry[1]), entry[2], *entry[3:4]) for entry in json.loads(text)))

    @property
    def numel(self) -> int:
        return sum(p.numel for p in self.params)

    def check_same(self, other: "Layout", self_rank: int, other_rank: int) -> None:
        """Raise LayoutMismatchError naming the first parameter where the two differ."""
        for index, (mine, theirs) in enumerate(zip(self.params, other.params)):
            if mine != theirs:
                raise LayoutMismatchError(
                    f"worker {other_rank} disagrees with worker {self_rank} at parameter #{index}: "
                    f"{theirs.name} {list(theirs.shape)} vs {mine.name} {list(mine.shape)}")
        if len(self.params) != len(other.params):
            longer, rank = (self, self_rank) if len(self.params) > len(other.params) else (other, other_rank)
            extra = longer.params[min(len(self.params), len(other.params))]
            raise LayoutMismatchError(
                f"workers {self_rank} and {other_rank} have {len(self.params)} and "
                f"{len(other.params)} parameters; first extra one (worker {rank}): {extra.name}")


def layout_of(model: Any, group_of: dict[int, int] | None = None) -> Layout:
    """A torch module's trainable parameters in backward order (the reverse of registration
    order, as DDP assumes); a shared parameter belongs to the first module that holds it.
    ``group_of`` maps id(param) to its optimizer parameter group (default 0)."""
    owner: dict[int, str] = {}
    for module_name, module in model.named_modules():
        for param in module.parameters(recurse=False):
            owner.setdefault(id(param), module_name)
    group_of = group_of or {}
    params = [ParamInfo(name, tuple(p.shape), owner[id(p)], group_of.get(id(p), 0))
              for name, p in model.named_parameters() if p.requires_grad]
    return Layout(tuple(reversed(params)))


@dataclasses.dataclass(frozen=True)
class Unit:
    """One module's parameters: a range of the flat buffer."""

    index: int
    module: str
    offset: int
    numel: int
    group: int = 0  # the optimizer parameter group of its parameters


@dataclasses.dataclass(frozen=True)
class Block:
    """A contiguous range of the flat buffer, owned by one shard."""

    block_id: str
    unit: int
    offset: int
    numel: int
    shard: int = 0


@dataclasses.dataclass(frozen=True)
class Group:
    """Consecutive units that travel together; ``blocks`` indexes Plan.blocks."""

    index: int
    units: tuple[int, ...]
    offset: int
    numel: int
    blocks: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Plan:
    version: int
    num_workers: int
    period: int
    shard_addresses: tuple[str, ...]
    units: tuple[Unit, ...]
    blocks: tuple[Block, ...]
    groups: tuple[Group, ...]
    knobs: tuple[tuple[str, str], ...] = ()  # the knob values the coordinator chose (--tune): the workers apply them
    predicted_s: float = 0.0  # the chosen schedule's predicted seconds per iteration (0: not tuned)
    runner_up: tuple[tuple[str, str], ...] = ()  # the fastest candidate with other knob values, and its prediction
    runner_up_s: float = 0.0
    switch_at: int = 0  # a re-tuned plan (v3 on): the iteration after whose backward every worker takes it

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        raw = json.loads(text)
        return cls(version=raw["version"], num_workers=raw["num_workers"], period=raw["period"],
                   shard_addresses=tuple(raw["shard_addresses"]),
                   units=tuple(Unit(**u) for u in raw["units"]),
                   blocks=tuple(Block(**b) for b in raw["blocks"]),
                   groups=tuple(Group(g["index"], tuple(g["units"]), g["offset"], g["numel"], tuple(g["blocks"]))
                                for g in raw["groups"]),
                   knobs=tuple((str(k), str(v)) for k, v in raw.get("knobs", ())),
                   predicted_s=float(raw.get("predicted_s", 0.0)),
                   runner_up=tuple((str(k), str(v)) for k, v in raw.get("runner_up", ())),
                   runner_up_s=float(raw.get("runner_up_s", 0.0)), switch_at=int(raw.get("switch_at", 0)))

    def group_blocks(self, group: Group) -> list[Block]:
        return [self.blocks[i] for i in group.blocks]

    def shard_bytes(self, shard: int) -> int:
        """Parameter bytes the mapping table assigns to ``shard``."""
        return sum(b.numel for b in self.blocks if b.shard == shard) * BYTES_PER_ELEMENT

    def shard_load(self) -> list[list[int]]:
        """Bytes each shard receives from one worker, per interleave phase: load[shard][phase]."""
        load = [[0] * self.period for _ in self.shard_addresses]
        for group in self.groups:
            for block in self.group_blocks(group):
                load[block.shard][phase(group.index, self.period)] += block.numel * BYTES_PER_ELEMENT
        return load


# -- units and blocks -----------------------------------------------------------------
def make_units(layout: Layout) -> list[Unit]:
    """One unit per module and optimizer parameter group, in backward order (a module's parameters are
    adjacent), so no block straddles two parameter groups."""
    units: list[Unit] = []
    offset = 0
    for param in layout.params:
        last = units[-1] if units else None
        if last and (last.module, last.group) == (param.module, param.group) and last.offset + last.numel == offset:
            units[-1] = dataclasses.replace(last, numel=last.numel + param.numel)
        else:
            units.append(Unit(len(units), param.module, offset, param.numel, param.group))
        offset += param.numel
    return units


def partition(units: Sequence[Unit], cap_bytes: int, num_shards: int = 1) -> list[Block]:
    """Blocks: each unit, split into near-equal partitions of at most ``cap_bytes``. A unit that needs splitting
    is split into a multiple of ``num_shards`` partitions where these stay at least MIN_BLOCK_BYTES, so that it
    can lie evenly on every shard (two 16 MB layers cut into 4 MiB partitions are 8 blocks, which 3 shards can
    only hold 3/3/2: the busiest shard would receive a third more than the others)."""
    if cap_bytes < BYTES_PER_ELEMENT:
        raise PlanError(f"partition cap {cap_bytes} B is below one element")
    cap = cap_bytes // BYTES_PER_ELEMENT
    blocks: list[Block] = []
    for unit in units:
        parts = -(-unit.numel // cap)
        if parts > 1:
            even = -(-parts // num_shards) * num_shards
            if unit.numel * BYTES_PER_ELEMENT // even >= min(MIN_BLOCK_BYTES, cap_bytes):
                parts = even
        bounds = [unit.offset + unit.numel * i // parts for i in range(parts + 1)]
        for start, end in zip(bounds, bounds[1:]):
            blocks.append(Block(f"b{len(blocks)}", unit.index, start, end - start))
    return blocks


def stripe(units: Sequence[Unit], unit_phase: Sequence[int], cap_bytes: int, num_shards: int,
           period: int = 1) -> list[Block]:
    """Blocks already placed, every shard holding the same bytes of each interleave phase.

    The units of a phase, laid end to end in backward order, are cut into ``num_shards * m`` equal stripes, the
    fewest that are at most ``cap_bytes`` each; stripe j goes to shard j mod S. A unit is cut where a stripe ends,
    unless that cuts off a piece under 1/64 of a stripe or MIN_PIECE_BYTES (a piece lies on the shard of the
    stripe holding its middle), so each shard holds m stripes of each phase, whatever the sizes of the layers: a
    1 MiB layer at 512 shards is spread over 11 of them instead of lying whole on one, and the consecutive layers
    of a group lie on consecutive shards, which take its pushes in parallel."""
    if cap_bytes < BYTES_PER_ELEMENT:
        raise PlanError(f"partition cap {cap_bytes} B is below one element")
    cap = cap_bytes // BYTES_PER_ELEMENT
    totals, start_in_phase = [0] * period, []
    for unit in units:
        start_in_phase.append(totals[unit_phase[unit.index]])
        totals[unit_phase[unit.index]] += unit.numel
    stripes = [num_shards * max(1, -(-total // (num_shards * cap))) for total in totals]
    blocks: list[Block] = []
    for unit, start in zip(units, start_in_phase):
        total, count = totals[unit_phase[unit.index]], stripes[unit_phase[unit.index]]
        least = max(total // count // 64, MIN_PIECE_BYTES // BYTES_PER_ELEMENT)  # the smallest piece cut off
        end = start + unit.numel
        cuts = [start]
        for edge in _stripe_edges(start, end, total, count):
            if edge - cuts[-1] >= least and end - edge >= least:
                cuts.append(edge)
        cuts.append(end)
        for begin, finish in zip(cuts, cuts[1:]):
            shard = _stripe_of((begin + finish) // 2, total, count) % num_shards
            blocks.append(Block(f"b{len(blocks)}", unit.index, unit.offset + begin - start, finish - begin, shard))
    return blocks


def _stripe_of(position: int, total: int, count: int) -> int:
    """The stripe (of ``count`` over ``total`` elements; stripe j begins at total * j // count) holding it."""
    j = position * count // total
    while j + 1 < count and total * (j + 1) // count <= position:
        j += 1
    while j > 0 and total * j // count > position:
        j -= 1
    return j


def _stripe_edges(begin: int, end: int, total: int, count: int) -> list[int]:
    """Where stripes begin strictly inside (begin, end)."""
    first = _stripe_of(begin, total, count) + 1
    edges = []
    for j in range(first, count):
        edge = total * j // count
        if edge >= end:
            break
        edges.append(edge)
    return edges


def fit_cost(samples: list[tuple[int, float]]) -> tuple[float, float]:
    """Least-squares alpha (s) and beta (s/byte) of ``seconds = alpha + beta * bytes``, both >= 0."""
    if not samples:
        return 0.0, 0.0
    sizes = [float(b) for b, _ in samples]
    times = [t for _, t in samples]
    mean_size, mean_time = statistics.fmean(sizes), statistics.fmean(times)
    spread = sum((b - mean_size) ** 2 for b in sizes)
    if spread == 0:
        return min(times), 0.0
    beta = max(0.0, sum((b - mean_size) * (t - mean_time) for b, t in zip(sizes, times)) / spread)
    alpha = max(0.0, mean_time - beta * mean_size)
    return alpha, beta


# -- fusion -----------------------------------------------------------------------------
def fuse_none(unit_bytes: Sequence[int]) -> list[list[int]]:
    """One group per module (WFBP)."""
    return [[i] for i in range(len(unit_bytes))]


def fuse_size(unit_bytes: Sequence[int], cap_bytes: int, first_cap_bytes: int) -> list[list[int]]:
    """DDP-style buckets in backward order: a small first group, then groups up to ``cap_bytes``."""
    groups: list[list[int]] = []
    current: list[int] = []
    size = 0
    for index, nbytes in enumerate(unit_bytes):
        cap = first_cap_bytes if not groups else cap_bytes
        if current and size + nbytes > cap:
            groups.append(current)
            current, size = [], 0
        current.append(index)
        size += nbytes
    if current:
        groups.append(current)
    return groups


def predicted_end(groups: Sequence[Sequence[int]], ready_s: Sequence[float], unit_bytes: Sequence[int],
                  alpha_s: float, beta_s_per_byte: float) -> float:
    """When the last transfer ends: a group starts once its last unit is ready and the link is free."""
    link_free = 0.0
    for group in groups:
        start = max(link_free, max(ready_s[i] for i in group))
        link_free = start + alpha_s + beta_s_per_byte * sum(unit_bytes[i] for i in group)
    return link_free


def fuse_cost(ready_s: Sequence[float], unit_bytes: Sequence[int], alpha_s: float,
              beta_s_per_byte: float) -> list[list[int]]:
    """The grouping of consecutive units with the smallest predicted end of the last transfer.

    ``ready_s[i]`` is when backward has produced unit i's gradient (non-decreasing).
    Dynamic programming over prefixes: the best end of a prefix only matters
    through that end time, and an earlier end is never worse.
    """
    count = len(unit_bytes)
    if count == 0:
        return []
    best_end = [0.0] + [math.inf] * count
    cut = [0] * (count + 1)
    for end in range(1, count + 1):
        size = 0
        for start in range(end, 0, -1):  # group = units start-1 .. end-1
            size += unit_bytes[start - 1]
            finish = max(best_end[start - 1], ready_s[end - 1]) + alpha_s + beta_s_per_byte * size
            if finish < best_end[end] - 1e-15:
                best_end[end], cut[end] = finish, start - 1
    groups: list[list[int]] = []
    end = count
    while end > 0:
        groups.append(list(range(cut[end], end)))
        end = cut[end]
    return groups[::-1]


# -- placement --------------------------------------------------------------------------
def place(block_bytes: Sequence[int], block_phases: Sequence[int], num_shards: int, period: int,
          policy: str = "lpt") -> list[int]:
    """Shard of each block. ``lpt``: largest first onto the shard least loaded in the block's
    phase (ties: least loaded overall, then lowest index). ``round-robin``: block i on shard i mod S."""
    if num_shards < 1:
        raise PlanError("placement needs at least one shard")
    if policy == "round-robin":
        return [i % num_shards for i in range(len(block_bytes))]
    if policy != "lpt":
        raise PlanError(f"unknown placement {policy!r}; choose from {', '.join(PLACEMENTS)}")
    load = [[0] * period for _ in range(num_shards)]
    total = [0] * num_shards
    heaps = [[(0, 0, s) for s in range(num_shards)] for _ in range(period)]  # per phase: (its load, total, shard)
    shard_of = [0] * len(block_bytes)
    for item in sorted(range(len(block_bytes)), key=lambda i: (-block_bytes[i], i)):
        p, heap = block_phases[item], heaps[block_phases[item]]
        while True:  # a shard's key only grows (a block of another phase raised its total): refresh a stale top
            target = heap[0][2]
            key = (load[target][p], total[target], target)
            if heap[0] == key:
                break
            heapq.heapreplace(heap, key)
        shard_of[item] = target
        load[target][p] += block_bytes[item]
        total[target] += block_bytes[item]
        heapq.heapreplace(heap, (load[target][p], total[target], target))
    return shard_of


AUTO_PARTITION_S = 0.008          # --partition-mib 0: a block's bytes take about this long on the worker's link...
MIN_AUTO_PARTITION = 64 << 10     # ...but no partition smaller than 64 KiB (a block's fixed CPU, see below)
MAX_AUTO_PARTITION = 8 << 20      # ...nor larger than 8 MiB (the spread of a group's blocks over the shards)


def auto_partition_bytes(link_mbps: float) -> int:
    """The partition cap for a worker link of ``link_mbps``: the power of two nearest to AUTO_PARTITION_S of its
    bytes, within [MIN_AUTO_PARTITION, MAX_AUTO_PARTITION]: 128 KiB at 100 Mbit/s, 1 MiB at 1 Gbit/s, 8 MiB
    at 10 Gbit/s. A power of two, because a layer's bytes are most often one times a power of two: a cap just
    under 1 MiB cuts a 9 MiB layer in 10 blocks, which 3 shards round up to 12, where 1 MiB cuts 9.
    Each block costs a push and a pulled block frame per worker at both ends (0.1-0.2 ms of CPU each, under the
    interpreter lock), whatever its bytes; a block is also what the pipeline fills and drains by at an
    iteration's ends (a round's pulls start with its first block's last push). Measured (``imerge bench``):
    B1 at 1 Gbit/s 0.78 s/it with 1 MiB blocks against 0.83-0.86 with 0.5 MiB (its CPU is the limit); B2 and
    tiny at 100 Mbit/s 1.07-1.10x their bound with 50-100 kB blocks against 1.22 and 1.3 with 1 MiB; on
    loopback (``bench datapath``, 10 Gbit/s) 4 and 8 MiB blocks 13% faster than 1 MiB, the shard's CPU per
    byte 20% lower."""
    link_bytes = max(link_mbps * 1e6 / 8 * AUTO_PARTITION_S, 1.0)
    return int(min(MAX_AUTO_PARTITION, max(MIN_AUTO_PARTITION, 1 << round(math.log2(link_bytes)))))


@dataclasses.dataclass(frozen=True)
class PlanOptions:
    """The job-level scheduling options the plan depends on (all workers must agree)."""

    fusion: str = "none"
    size_cap_bytes: int = 25 << 20
    first_cap_bytes: int = 1 << 20
    partition_bytes: int = 1 << 20
    placement: str = "lpt"
    period: int = 1
    tune: str = ""  # the knobs the coordinator chooses at the plan switch (comma list; empty: none)
    retune_window: int = 0  # with tune: iterations per window of online re-tuning (0: decided once)

    @property
    def tuned_knobs(self) -> list[str]:
        return [knob for knob in self.tune.split(",") if knob]

    @property
    def switches(self) -> bool:
        """Whether the job switches to a second plan (COST_PLAN) after its profiled iterations."""
        return self.fusion == "cost" or bool(self.tune)

    def validate(self) -> "PlanOptions":
        if self.fusion not in FUSIONS:
            raise PlanError(f"unknown fusion {self.fusion!r}; choose from {', '.join(FUSIONS)}")
        if self.placement not in PLACEMENTS:
            raise PlanError(f"unknown placement {self.placement!r}")
        if not set(self.tuned_knobs) <= set(JOB_KNOBS):
            raise PlanError(f"tune {self.tune!r}: only {', '.join(JOB_KNOBS)} can be tuned in a job")
        if self.retune_window < 0 or (self.retune_window and not self.tune):
            raise PlanError("retune_window must be >= 0, and 0 where nothing is tuned")
        if self.period < 1 or min(self.size_cap_bytes, self.first_cap_bytes, self.partition_bytes) < 4:
            raise PlanError("period must be >= 1 and every cap at least 4 bytes")
        return self


def make_plan(layout: Layout, num_workers: int, shard_addresses: Sequence[str], version: int,
              options: PlanOptions = PlanOptions(), groups: Sequence[Sequence[int]] | None = None,
              blocks_of: Sequence[Block] | None = None) -> Plan:
    """The plan for ``layout``. ``groups`` overrides the fusion (the cost planner's result);
    ``blocks_of`` keeps an earlier plan's blocks and their placement (blocks are stable for the job)."""
    options.validate()
    if not layout.params:
        raise PlanError("the model has no trainable parameters")
    units = make_units(layout)
    unit_bytes = [u.numel * BYTES_PER_ELEMENT for u in units]
    if groups is None:
        groups = (fuse_size(unit_bytes, options.size_cap_bytes, options.first_cap_bytes)
                  if options.fusion == "size" else fuse_none(unit_bytes))
    group_of_unit = {u: g for g, members in enumerate(groups) for u in members}
    if sorted(group_of_unit) != list(range(len(units))):
        raise PlanError("groups must cover every unit exactly once")
    if blocks_of is not None:
        blocks = list(blocks_of)
        if sum(b.numel for b in blocks) != sum(u.numel for u in units):
            raise PlanError("the earlier plan's blocks do not cover this layout")
    else:
        blocks = place_blocks(units, [phase(group_of_unit[u.index], options.period) for u in units],
                              len(shard_addresses), options)
    blocks_of_group: list[list[int]] = [[] for _ in groups]
    for i, block in enumerate(blocks):
        blocks_of_group[group_of_unit[block.unit]].append(i)
    plan_groups = []
    for index, members in enumerate(groups):
        if list(members) != list(range(members[0], members[-1] + 1)):
            raise PlanError(f"group {index} is not a run of consecutive units: {list(members)}")
        first, last = units[members[0]], units[members[-1]]
        plan_groups.append(Group(index, tuple(members), first.offset, last.offset + last.numel - first.offset,
                                 tuple(blocks_of_group[index])))
    return Plan(version, num_workers, options.period, tuple(shard_addresses), tuple(units), tuple(blocks),
                tuple(plan_groups))


def place_blocks(units: Sequence[Unit], unit_phase: Sequence[int], num_shards: int, options: PlanOptions
                 ) -> list[Block]:
    """The units cut into blocks, each on its shard, as ``options.placement`` says. With lpt or round-robin and
    MANY_SHARDS or more, the partition cap shrinks to a shard's even share of the heaviest phase over
    BLOCKS_PER_SHARD (never under MIN_BLOCK_BYTES): at 512 shards a 1 MiB layer whole on one is 11 times that
    shard's share of ResNet-18, and the shard links take a group's pushes in parallel only if its blocks are
    spread over them. With fewer shards, a share of any model worth 16 MiB per shard is 16 partitions already,
    and a small model's blocks stay as few as its layers (each block costs the shards a message per worker)."""
    if options.placement == "stripe":
        return stripe(units, unit_phase, options.partition_bytes, num_shards, options.period)
    phase_bytes = [0] * options.period
    for unit in units:
        phase_bytes[unit_phase[unit.index]] += unit.numel * BYTES_PER_ELEMENT
    cap = options.partition_bytes
    if num_shards >= MANY_SHARDS:
        cap = min(cap, max(MIN_BLOCK_BYTES, max(phase_bytes) // (num_shards * BLOCKS_PER_SHARD)))
    blocks = partition(units, cap, num_shards)
    shards = place([b.numel * BYTES_PER_ELEMENT for b in blocks], [unit_phase[b.unit] for b in blocks],
                   num_shards, options.period, options.placement)
    return [Block(b.block_id, b.unit, b.offset, b.numel, s) for b, s in zip(blocks, shards)]
