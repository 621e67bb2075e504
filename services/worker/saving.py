"""``imerge.save`` / ``imerge.load``: the model, its buffers and the shards' optimizer state in one file.

The file is safetensors (nothing pickled): ``model/<key>`` holds the wrapped
module's ``state_dict()`` (parameters and buffers), ``optim/<param>/<name>``
each parameter's optimizer state, put back together from its pieces on the
shards (a per-element state flat, a scalar such as Adam's ``step`` as one
value), and the metadata says the format, the iteration and the optimizer.
Since the state is stored per parameter, a file saved on one block layout
(shard count, partition size) loads into another.

Every worker calls both at the same point of its loop. ``save`` waits for the
in-flight syncs and worker 0 writes the file; ``load`` has worker 0 read it,
load the module and import the parameters and optimizer state into every
block, and the other workers fetch the parameters once it has.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import safe_open
from safetensors.torch import load as load_safetensors, save_file

from imerge.control.messages import Loaded
from imerge.core.blockstate import block_state_bytes
from imerge.core.errors import IMergeError, InvalidArgument, JobFailed
from imerge.core.optim import OptimizerSpec
from imerge.core.planning import Block

if TYPE_CHECKING:
    from .api import DistributedModel
    from .engine import SyncEngine

FORMAT = "imerge-save-1"


def _block_pieces(engine: SyncEngine, block: Block) -> list[tuple[str, int, int]]:
    """(parameter name, offset of the piece within the parameter, elements) of each piece of ``block``."""
    names, ranges = engine.names, engine.flat.range
    return [(names[pid], max(block.offset - ranges[pid][0], 0), numel) for pid, numel in engine.flat.pieces(block)]


def shard_state(engine: SyncEngine) -> tuple[torch.Tensor, dict[str, dict[str, torch.Tensor]]]:
    """The shards' fp32 parameters (flat, as the engine lays them out) and each parameter's optimizer state by
    name (a per-element state flat, a scalar as one value), once this worker's in-flight syncs are done."""
    engine.synchronize()
    states = engine.export_states()
    by_param: dict[str, dict[str, list[torch.Tensor]]] = {}
    masters = torch.empty(engine.flat.values.numel())  # the shards' fp32 parameters (compressed pulls round them)
    for block in sorted(engine.plan.blocks, key=lambda b: b.offset):
        state = load_safetensors(states[block.block_id])
        masters[block.offset:block.offset + block.numel] = state["param"]
        for index, (name, _, _) in enumerate(_block_pieces(engine, block)):
            for key in [k for k in state if k.startswith(f"state/{index}/")]:
                parts = by_param.setdefault(name, {}).setdefault(key.split("/", 2)[2], [])
                value = state[key]
                if value.dim() > 0 or not parts:  # per-element pieces concatenate; a scalar is the same on each
                    parts.append(value.reshape(-1) if value.dim() > 0 else value)
    return masters, {name: {key: torch.cat(parts) if parts[0].dim() > 0 else parts[0] for key, parts in by_key.items()}
                     for name, by_key in by_param.items()}


def optimizer_state(engine: SyncEngine) -> dict[int, dict[str, torch.Tensor]]:
    """Each trained parameter's optimizer state on the shards (by ``id(param)``), shaped as torch.optim keeps it:
    what the script's ``optimizer.state_dict()`` returns under IMerge."""
    by_name = shard_state(engine)[1]
    return {id(param): {key: value.reshape(param.shape) if value.dim() > 0 else value
                        for key, value in by_name.get(engine.names[id(param)], {}).items()}
            for param in engine.params}


def save_model(model: DistributedModel, path: str | os.PathLike[str], iteration: int) -> None:
    engine = model.engine
    if model.config.rank != 0:
        engine.synchronize()
        return
    masters, by_param = shard_state(engine)
    tensors = {f"model/{key}": value.detach().cpu().clone().contiguous()
               for key, value in model.module.state_dict().items()}
    for name, param in model.module.named_parameters(remove_duplicate=False):
        if id(param) in engine.flat.range and f"model/{name}" in tensors:
            offset, numel = engine.flat.range[id(param)]
            tensors[f"model/{name}"] = masters[offset:offset + numel].reshape(param.shape).clone()
    tensors.update({f"optim/{name}/{key}": value for name, by_key in by_param.items() for key, value in by_key.items()})
    metadata = {"format": FORMAT, "iteration": str(iteration), "optimizer": engine.optimizer.spec.to_json(),
                "world_size": str(model.config.world_size)}
    target = Path(path)
    temporary = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    save_file(tensors, str(temporary), metadata=metadata)
    os.replace(temporary, target)


def read_file(path: str | os.PathLike[str]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    try:
        with safe_open(str(path), framework="pt") as handle:
            metadata = handle.metadata() or {}
            tensors = {key: handle.get_tensor(key) for key in handle.keys()}
    except (OSError, ValueError, RuntimeError) as exc:
        raise InvalidArgument(f"imerge.load: {path} is not a readable safetensors file: {exc}") from None
    except Exception as exc:  # noqa: BLE001 - safetensors raises its own error types for malformed files
        raise InvalidArgument(f"imerge.load: {path} is not a readable safetensors file: {exc}") from None
    if metadata.get("format") != FORMAT:
        raise InvalidArgument(f"imerge.load: {path} is not an imerge.save file (format {metadata.get('format')!r})")
    return tensors, metadata


def block_states(engine: SyncEngine, optim: dict[str, dict[str, torch.Tensor]]) -> dict[str, bytes]:
    """Each block's parameters (the loaded module's) and optimizer state, cut from the file's per-parameter state."""
    engine.flat.stage_to_host()
    states = {}
    for block in engine.plan.blocks:
        state = {}
        for index, (name, start, numel) in enumerate(_block_pieces(engine, block)):
            for key, value in optim.get(name, {}).items():
                state[f"{index}/{key}"] = value[start:start + numel].clone() if value.dim() > 0 else value.clone()
        states[block.block_id] = block_state_bytes(engine.flat.host_slice(block).clone(), state)
    return states


def check_optimizer_state(engine: SyncEngine, optim: dict[str, dict[str, torch.Tensor]], path: Any) -> None:
    """Refuse a file whose optimizer state names a parameter this model does not train, or whose per-element
    state does not match the parameter's size: loading it would drop or misplace that state silently."""
    numel = {engine.names[pid]: count for pid, (_, count) in engine.flat.range.items()}
    unknown = sorted(set(optim) - set(numel))
    if unknown:
        raise InvalidArgument(f"imerge.load: {path} holds optimizer state for parameters this model does not "
                              f"train: {', '.join(unknown[:5])}{' ...' if len(unknown) > 5 else ''}")
    for name, by_key in optim.items():
        for key, value in by_key.items():
            if value.dim() > 0 and value.numel() != numel[name]:
                raise InvalidArgument(f"imerge.load: {path} holds optimizer state {key!r} of {name} with "
                                      f"{value.numel()} elements; the parameter has {numel[name]}")


def load_model(model: DistributedModel, path: str | os.PathLike[str]) -> dict[str, str]:
    engine, config = model.engine, model.config
    engine.synchronize()
    sequence = engine.next_load()
    if config.rank == 0:
        try:
            tensors, metadata = read_file(path)
            saved = OptimizerSpec.from_json(metadata["optimizer"])
            if saved.name != engine.optimizer.spec.name:
                raise InvalidArgument(f"imerge.load: {path} holds the state of optimizer {saved.name!r}; this job "
                                      f"runs {engine.optimizer.spec.name!r}")
            with engine.loading():
                model.module.load_state_dict({k[6:]: v for k, v in tensors.items() if k.startswith("model/")})
            optim: dict[str, dict[str, torch.Tensor]] = {}
            for key, value in tensors.items():
                if key.startswith("optim/"):
                    name, _, state_name = key[6:].rpartition("/")
                    optim.setdefault(name, {})[state_name] = value
            check_optimizer_state(engine, optim, path)
            engine.load_states(block_states(engine, optim), config.wait_timeout_s, "the shards to import the loaded "
                               "state")
        except IMergeError as exc:
            engine.store.announce_loaded(engine.generation, sequence, Loaded(f"worker 0 could not load {path}: {exc}"))
            raise
        engine.store.announce_loaded(engine.generation, sequence, Loaded("", json.dumps(metadata)))
        engine.share_module_state(-1 - sequence)  # its frozen parameters and buffers: every worker's
        return metadata
    loaded = engine.store.wait_loaded(engine.generation, sequence, config.wait_timeout_s)
    if loaded.error:
        raise JobFailed(loaded.error)
    engine.fetch_all("the loaded parameters from the shards")
    engine.share_module_state(-1 - sequence)
    metadata_read: dict[str, str] = json.loads(loaded.metadata)
    return metadata_read


def save(model: DistributedModel, path: str | os.PathLike[str]) -> None:
    """Save the model (parameters and buffers) and the shards' optimizer state to ``path`` (safetensors).

    Every worker calls it at the same point of its loop; worker 0 writes the file. An LR scheduler's or a grad
    scaler's state is the script's: save their ``state_dict()`` as with DDP.
    """
    with model._reporting():
        save_model(model, path, model.engine.iteration)


def load(model: DistributedModel, path: str | os.PathLike[str]) -> dict[str, Any]:
    """Load a file of :func:`save` into the job: worker 0 reads it (only it needs the file) and the shards take its
    parameters and optimizer state; every worker calls it at the same point (before training, or between two
    iterations). Returns the file's metadata, with ``iteration`` (the iterations done when it was saved: the
    data position to continue from), also kept as ``model.start_iteration``."""
    with model._reporting():
        metadata = load_model(model, path)
    model.start_iteration = int(metadata.get("iteration", 0))
    return {**metadata, "iteration": model.start_iteration}
