"""The schedule's knobs: the options a tuner may choose, each a few named values. Pure data.

A knob's value is a set of :class:`~imerge.core.schedule_config.ScheduleConfig`
fields; the first value of a knob is its plainest. ``imerge simulate --explain``
searches every knob; a running job (``--tune``) switches only the knobs in
``JOB_KNOBS`` at its plan switch: the ones that change neither the blocks on
the shards (partition, placement: fixed by the first plan) nor what travels
(compression: lossy, the user's to choose).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any, TypeVar

KNOBS: dict[str, dict[str, dict[str, Any]]] = {
    "fusion": {"none": dict(fusion="none"), "size": dict(fusion="size"), "cost": dict(fusion="cost")},
    "priority": {"on": dict(priority=True), "off": dict(priority=False)},
    "slots": {"off": dict(slots="off"), "port": dict(slots="ack", slot_scope="shard", slot_width=0),
              "port/2": dict(slots="ack", slot_scope="shard", slot_width=2),
              "group": dict(slots="ack", slot_scope="group", slot_width=1)},
    "partition": {"auto": dict(partition_mib=0.0), "1 MiB": dict(partition_mib=1.0),
                  "0.25 MiB": dict(partition_mib=0.25), "4 MiB": dict(partition_mib=4.0)},
    "placement": {"lpt": dict(placement="lpt"), "stripe": dict(placement="stripe")},
    "compression": {"none": dict(compression="none"), "fp16": dict(compression="fp16"),
                    "mixed": dict(compression="mixed")},
}
JOB_KNOBS = ("fusion", "priority", "slots")  # what a running job's plan switch may change
TUNE_AUTO, TUNE_NONE = "auto", "none"

S = TypeVar("S")


def knob_fields(knob: str) -> set[str]:
    """The ScheduleConfig fields any value of ``knob`` sets."""
    return {key for choice in KNOBS[knob].values() for key in choice}


def apply(base: S, knobs: Mapping[str, str] | Iterable[tuple[str, str]]) -> S:
    """``base`` (a ScheduleConfig or a subclass) with the fields of the named knob values."""
    fields: dict[str, Any] = {}
    for knob, value in dict(knobs).items():
        fields.update(KNOBS[knob][value])
    return dataclasses.replace(base, **fields) if fields else base  # type: ignore[type-var]


def knobs_of(schedule: Any, knobs: Iterable[str]) -> dict[str, str]:
    """The values ``schedule`` has of ``knobs`` (a knob whose fields match none of its values: its first value)."""
    values = {}
    for knob in knobs:
        matching = [name for name, fields in KNOBS[knob].items()
                    if all(getattr(schedule, key) == value for key, value in fields.items())]
        values[knob] = matching[0] if matching else next(iter(KNOBS[knob]))
    return values


def free_job_knobs(explicit: set[str], period: int) -> list[str]:
    """The knobs of ``JOB_KNOBS`` a running job may choose: none of their fields given explicitly, and fusion only
    at T = 1 (with T > 1 the groups decide which parameters take local steps together: the result)."""
    return [knob for knob in JOB_KNOBS if not knob_fields(knob) & explicit and (knob != "fusion" or period == 1)]


def parse_tune(value: str) -> list[str]:
    """The knobs a resolved ``--tune`` value names ('none': no knob); ValueError naming the unknown one."""
    if value == TUNE_NONE:
        return []
    knobs = [part.strip() for part in value.split(",") if part.strip()]
    unknown = [knob for knob in knobs if knob not in JOB_KNOBS]
    if unknown or not knobs:
        raise ValueError(f"{value!r}: give auto, none or a comma list of {', '.join(JOB_KNOBS)}")
    return knobs


def describe(knobs: Mapping[str, str] | Iterable[tuple[str, str]]) -> str:
    """``fusion size, priority on``; no knob: 'the given schedule'."""
    return ", ".join(f"{knob} {value}" for knob, value in dict(knobs).items()) or "the given schedule"
