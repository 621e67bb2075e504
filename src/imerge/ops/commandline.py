"""What ``imerge`` does to a command line before argparse reads it, with torchrun's habits in mind. Pure.

* torchrun spells its flags with underscores (``--nproc_per_node``); each flag
  of ours is accepted in that spelling too (``--nproc-per-node``), and
  torchrun's flags that have no counterpart here are refused naming what to do;
* a script after ``--`` that starts with ``python`` or ``python3`` runs on the
  interpreter ``imerge`` itself runs on (``sys.executable``: the virtual
  environment's, activated or not), as torchrun does; a path (``/usr/bin/python3``,
  ``./python``) is run as given;
* a command given without ``--`` (``imerge launch python train.py``) is refused
  with the corrected line.
"""
from __future__ import annotations

import shlex
import sys
from collections.abc import Iterable

COMMAND_ROLES = ("launch", "testbed", "worker")  # the roles that run a command given after --
OWN_PYTHON = ("python", "python3")
TORCHRUN_ONLY = {  # torchrun's flags without a counterpart: what to do instead
    "--standalone": "imerge launch always runs its job on this host: leave it out",
    "--nnodes": "imerge launch runs on one host; across hosts run 'imerge worker --nproc-per-node N --node-rank I "
                "--world-size W' on each",
    "--rdzv-endpoint": "the job meets through its coordinator and Redis: give --redis-url",
    "--rdzv-backend": "the job meets through its coordinator and Redis: give --redis-url",
    "--rdzv-id": "name the job with --job",
    "--master-addr": "the job meets through its coordinator and Redis: give --redis-url",
    "--master-port": "the job meets through its coordinator and Redis: give --redis-url",
}


def dashed(argv: list[str], known: Iterable[str]) -> list[str]:
    """``argv`` with each ``--flag_name`` (torchrun's spelling) that is ``--flag-name`` in ``known`` respelled."""
    flags, out = set(known), []
    for token in argv:
        name, equals, value = token.partition("=")
        if name.startswith("--") and "_" in name and name.replace("_", "-") in flags:
            token = name.replace("_", "-") + equals + value
        out.append(token)
    return out


def torchrun_only(argv: list[str], known: Iterable[str]) -> str:
    """Why a torchrun flag in ``argv`` that is not one of ``known`` cannot be taken ('' if none is)."""
    flags = set(known)
    for token in argv:
        name = token.partition("=")[0].replace("_", "-")
        if name in TORCHRUN_ONLY and name not in flags:
            return f"{token.partition('=')[0]} is torchrun's: {TORCHRUN_ONLY[name]}"
    return ""


def own_python(command: list[str]) -> list[str]:
    """``command`` with a bare ``python`` or ``python3`` replaced by this interpreter."""
    if command and command[0] in OWN_PYTHON:
        return [sys.executable, *command[1:]]
    return command


def without_separator(role: str, argv: list[str], extras: list[str]) -> str:
    """The error for a command given without ``--``: ``extras`` are what argparse could not place; '' if they do
    not start with a command (an unknown flag is argparse's to report)."""
    if role not in COMMAND_ROLES or not extras or extras[0].startswith("-"):
        return ""
    start = argv.index(extras[0], 1)  # the command runs from its first word to the end of the line
    options, command = argv[1:start], argv[start:]
    line = shlex.join(["imerge", role, *options, "--", *command])
    return f"the command to run goes after --: {line}"
