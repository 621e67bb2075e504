"""The worker's sync engine: fusion buffers, gradient hooks, the comm loop, forward waits.

* Each group of the plan owns a flat parameter buffer (module parameters are
  views into it, so a pull writes them without per-tensor copies) and a flat
  gradient buffer, both allocated once.
* A parameter's post-accumulate-grad hook copies its gradient into its slot
  and bumps the group's counter; the group that completes goes on the comm
  queue at once and backward continues.
* The comm loop (an asyncio loop in its own thread) pushes each group, then
  starts its pull without waiting for it; the pull writes the parameters and
  resolves the group's Future, shared by all its members.
* A module's forward pre-hook waits on the Futures of its parameters' groups.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections.abc import Coroutine
from typing import Any

import torch

from imerge.errors import IMergeError, WaitTimeout
from imerge.optim import OptimizerSpec
from imerge.planning import Block, Group, Plan

from .config import WorkerConfig
from .transport import ShardClient

log = logging.getLogger(__name__)


class CommLoop:
    """The worker's comm thread: an asyncio event loop running in a daemon thread."""

    def __init__(self, name: str):
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def submit(self, coro: Coroutine) -> concurrent.futures.Future:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine, timeout_s: float, what: str) -> Any:
        future = self.submit(coro)
        try:
            return future.result(timeout_s)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise WaitTimeout(f"timed out after {timeout_s:g}s waiting for {what}") from None

    def close(self) -> None:
        if self._thread.is_alive():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(10)


class GroupRuntime:
    """One fusion group's buffers and its sync state on this worker."""

    def __init__(self, group: Group, blocks: list[Block], params: list[torch.nn.Parameter]):
        self.group = group
        self.blocks = blocks
        self.params = params
        self.slices: dict[int, slice] = {}
        device = params[0].device
        pinned = device.type == "cuda"
        self.param_buf = torch.empty(group.numel, device=device)
        self.host_params = torch.empty(group.numel, pin_memory=pinned) if pinned else self.param_buf
        self.grad_buf = torch.zeros(group.numel, pin_memory=pinned)
        offset = 0
        with torch.no_grad():
            for param in params:
                view = self.param_buf[offset:offset + param.numel()]
                view.copy_(param.detach().reshape(-1))
                param.data = view.view_as(param)
                self.slices[id(param)] = slice(offset, offset + param.numel())
                offset += param.numel()
        self.filled = [False] * len(params)
        self.position = {id(p): i for i, p in enumerate(params)}
        self.ready = 0
        self.round = 0
        self.future: concurrent.futures.Future | None = None
        self.push_done = threading.Event()
        self.push_done.set()
        self.pull_task: asyncio.Task | None = None

    @property
    def name(self) -> str:
        return f"group {self.group.index} ({', '.join(self.group.params[:3])}{', ...' if len(self.params) > 3 else ''})"

    def write_grad(self, param: torch.nn.Parameter) -> bool:
        """Copy ``param``'s gradient into its slot; True when the group is complete."""
        self.grad_buf[self.slices[id(param)]].copy_(param.grad.detach().reshape(-1))
        index = self.position[id(param)]
        if not self.filled[index]:
            self.filled[index] = True
            self.ready += 1
        return self.ready == len(self.params)

    def zero_missing(self) -> None:
        """Zero the slots of parameters that got no gradient in this backward."""
        for param, filled in zip(self.params, self.filled):
            if not filled:
                self.grad_buf[self.slices[id(param)]].zero_()

    def reset(self) -> None:
        self.filled = [False] * len(self.params)
        self.ready = 0

    def host_slice(self, block: Block) -> torch.Tensor:
        return self.host_params[block.offset:block.offset + block.numel]

    def stage_to_host(self) -> None:
        if self.host_params is not self.param_buf:
            self.host_params.copy_(self.param_buf)

    def load_host_params(self) -> None:
        if self.host_params is not self.param_buf:
            self.param_buf.copy_(self.host_params)


class SyncEngine:
    def __init__(self, model: torch.nn.Module, plan: Plan, config: WorkerConfig, optimizer: OptimizerSpec):
        self.plan = plan
        self.config = config
        self.optimizer = optimizer.validate()
        self.comm = CommLoop(f"imerge-comm-{config.rank}")
        self.clients: list[ShardClient] = self.comm.run(self._connect(), 30, "the shard channels to open")
        params = dict(model.named_parameters())
        self.groups = [GroupRuntime(g, plan.blocks_of_group(g.index), [params[n] for n in g.params])
                       for g in plan.groups]
        self._group_of = {id(p): g for g in self.groups for p in g.params}
        self._queue: asyncio.Queue = asyncio.Queue()
        self._consumer = self.comm.submit(self._comm_main())
        self._enqueued: set[int] = set()
        self._callback_queued = False
        self.iterations = 0
        self.bytes_pushed = 0
        self._handles = self._install_hooks(model)

    # -- setup ------------------------------------------------------------------
    async def _connect(self) -> list[ShardClient]:
        return [ShardClient(address) for address in self.plan.shard_addresses]

    def _install_hooks(self, model: torch.nn.Module) -> list[Any]:
        handles = [p.register_post_accumulate_grad_hook(self._on_grad)
                   for g in self.groups for p in g.params]
        for module in model.modules():
            groups = {id(self._group_of[id(p)]): self._group_of[id(p)]
                      for p in module.parameters(recurse=False) if id(p) in self._group_of}
            if groups:
                waits = sorted(groups.values(), key=lambda g: g.group.index)
                handles.append(module.register_forward_pre_hook(
                    lambda _module, _args, waits=waits: self._wait_groups(waits)))
        return handles

    def initialize(self, store: Any) -> None:
        """Rank 0 creates every block; then every worker fetches the current parameters."""
        cfg = self.config
        timeout = cfg.rpc_timeout_s * max(1, len(self.plan.blocks))
        event = f"blocks-ready:{self.plan.version}"
        if cfg.rank == 0:
            try:
                self.comm.run(self._init_blocks(), timeout, "the shards to accept the initial parameters")
            except Exception as exc:
                store.set_event(event, f"worker 0 could not initialize the blocks: {exc}")
                raise
            store.set_event(event, "")
        else:
            failure = store.wait_event(event, cfg.wait_timeout_s, "worker 0 to initialize the blocks on the shards")
            if failure:
                raise IMergeError(failure)
        self.comm.run(self._fetch_all(), timeout, "the initial parameters from the shards")

    async def _init_blocks(self) -> None:
        spec = self.optimizer
        for group in self.groups:
            group.stage_to_host()
        await asyncio.gather(*(
            self.clients[b.shard].init_block(b.block_id, self.plan.num_workers, spec, g.host_slice(b),
                                             self.config.rpc_timeout_s)
            for g in self.groups for b in g.blocks))

    async def _fetch_all(self) -> None:
        for group in self.groups:
            rounds = await asyncio.gather(*(
                self.clients[b.shard].fetch_into(b.block_id, group.host_slice(b),
                                                 self.config.rpc_timeout_s) for b in group.blocks))
            if len(set(rounds)) != 1:
                raise IMergeError(f"{group.name}: its blocks are at different rounds {rounds}")
            group.round = rounds[0]
            group.load_host_params()

    # -- backward: hooks ----------------------------------------------------------
    def _on_grad(self, param: torch.nn.Parameter) -> None:
        group = self._group_of[id(param)]
        if not group.push_done.is_set():  # two backwards without a forward: let the push finish
            self._wait(group.push_done.wait, group, "its previous push to finish")
        if not self._callback_queued:
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
            self._callback_queued = True
        complete = group.write_grad(param)
        param.grad = None
        if complete:
            self._enqueue(group)

    def _end_of_backward(self) -> None:
        """Groups some of whose parameters got no gradient are sent with zeros there."""
        for group in self.groups:
            if group.group.index not in self._enqueued:
                group.zero_missing()
                self._enqueue(group)
        self._enqueued.clear()
        self._callback_queued = False
        self.iterations += 1

    def _enqueue(self, group: GroupRuntime) -> None:
        group.reset()
        group.push_done.clear()
        group.future = concurrent.futures.Future()
        self._enqueued.add(group.group.index)
        self.comm.loop.call_soon_threadsafe(self._queue.put_nowait, (group, group.future))

    # -- comm loop ----------------------------------------------------------------
    async def _comm_main(self) -> None:
        while True:
            group, future = await self._queue.get()
            if group is None:
                return
            try:
                if group.pull_task is not None:
                    await asyncio.wait([group.pull_task])
                await self._push_group(group)
            except Exception as exc:  # routed to whoever waits on the group
                future.set_exception(exc)
                continue
            finally:
                group.push_done.set()
            group.pull_task = asyncio.get_running_loop().create_task(self._pull_group(group, future))

    async def _push_group(self, group: GroupRuntime) -> None:
        for block in group.blocks:
            grad = group.grad_buf[block.offset:block.offset + block.numel]
            await self.clients[block.shard].push(block.block_id, self.config.rank, group.round, grad,
                                                 self.config.rpc_timeout_s)
            self.bytes_pushed += grad.numel() * 4

    async def _pull_group(self, group: GroupRuntime, future: concurrent.futures.Future) -> None:
        try:
            rounds = await asyncio.gather(*(
                self.clients[b.shard].pull_into(b.block_id, self.config.rank, group.round,
                                                group.host_slice(b),
                                                self.config.pull_timeout_s) for b in group.blocks))
            if any(r != group.round + 1 for r in rounds):
                raise IMergeError(f"{group.name}: expected round {group.round + 1}, shards answered {rounds}")
            group.load_host_params()
            group.round += 1
            future.set_result(group.round)
        except Exception as exc:
            future.set_exception(exc)

    # -- forward: waits -------------------------------------------------------------
    def _wait_timeout(self) -> float:
        return self.config.pull_timeout_s + self.config.rpc_timeout_s + 10.0

    def _wait(self, wait: Any, group: GroupRuntime, what: str) -> Any:
        timeout = self._wait_timeout()
        started = time.monotonic()
        try:
            result = wait(timeout)
        except concurrent.futures.TimeoutError:
            result = False
        if result is False:
            raise WaitTimeout(f"worker {self.config.rank}: timed out after {time.monotonic() - started:.1f}s "
                              f"waiting for {group.name} {what}")
        return result

    def _wait_groups(self, groups: list[GroupRuntime]) -> None:
        for group in groups:
            future = group.future
            if future is not None and not future.done():
                self._wait(future.result, group, f"round {group.round + 1} to be pulled")
            elif future is not None:
                future.result()  # re-raise a failed sync

    def synchronize(self) -> None:
        """Wait until every group's latest sync completed (re-raising its error)."""
        self._wait_groups(self.groups)

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        if self.comm.loop.is_running():
            self.comm.loop.call_soon_threadsafe(self._queue.put_nowait, (None, None))
            try:
                self._consumer.result(10)
            except Exception:  # noqa: BLE001 - closing anyway
                pass
            self.comm.run(self._close_clients(), 10, "the shard channels to close")
        self.comm.close()

    async def _close_clients(self) -> None:
        tasks = [g.pull_task for g in self.groups if g.pull_task is not None and not g.pull_task.done()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*(c.close() for c in self.clients), return_exceptions=True)
