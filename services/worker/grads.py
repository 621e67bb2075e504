"""Each parameter's ``.grad``, and the gradient accumulator behind it.

With T = 1 every ``.grad`` is the parameter's slice of the flat accumulator
(DDP's ``gradient_as_bucket_view``) once its gradient is in: the push reads it,
and after backward it holds this worker's gradient for the loop to read (the
average never exists on a worker). A group's slice is never zeroed between
iterations: while it holds the last push (``dirty``), its parameters' ``.grad``
are None from the forward on, and each parameter's first gradient is copied over
its piece (:meth:`LocalGrads.take`; one pass, where zeroing the slice and adding
into it took two, and every later gradient of the same sync is added in place by
autograd); the pieces that got no gradient are zeroed just before the next push
(:meth:`LocalGrads.zero_stale`). With T > 1, ``.grad`` is the tensor autograd
made, dropped at the next forward, and the accumulator keeps the sum of the
gradients since the group's last sync.
"""
from __future__ import annotations

import torch

from imerge.core.errors import IMergeError

from .buffers import FlatParams
from .groups import GroupRuntime
from .guarded import internal
from .staging import HostStaging


class LocalGrads:
    def __init__(self, flat: FlatParams, params: list[torch.nn.Parameter], bucket_views: bool):
        self.flat, self.params, self.bucket_views = flat, params, bucket_views
        self.views = {id(p): flat.grad_view(p) for p in params} if bucket_views else {}

    @staticmethod
    def free(group: GroupRuntime, staging: HostStaging) -> bool:
        """Whether the group's slice may be overwritten now (on the CPU the push reads the accumulator itself)."""
        return group.pushed() or not staging.wire_reads_accumulator

    def clear(self, group: GroupRuntime) -> None:
        self.flat.grads[group.group.offset:group.group.offset + group.group.numel].zero_()
        group.dirty = False

    def zero_stale(self, group: GroupRuntime) -> None:
        """The pieces of a pushed slice that got no gradient since become zeros (its push is out: the caller
        waited: ``rounds.settle_stale``); the whole slice is this sync's from here on."""
        if not group.dirty:
            return
        if not group.given or not self.bucket_views:
            self.clear(group)
            return
        for param in group.params:
            if id(param) not in group.given:
                self.views[id(param)].zero_()
        group.dirty = False

    def before_forward(self, groups: list[GroupRuntime], staging: HostStaging) -> None:
        """A forward that records gradients: last iteration's local gradients make way for this one's."""
        with internal():
            for group in groups:
                if not self.bucket_views:  # T > 1: autograd makes a new .grad
                    if group.dirty and self.free(group, staging):
                        self.clear(group)
                    self._set(group.params, None)
                elif group.dirty:  # the slice holds the last push: a first gradient overwrites its piece (take)
                    self._set([p for p in group.params if id(p) not in group.given], None)
                else:  # from here on .grad is the accumulator's slice: autograd adds into it
                    for param in group.params:
                        param.grad = self.views[id(param)]

    @staticmethod
    def _set(params: list[torch.nn.Parameter], grad: None) -> None:
        for param in params:
            param.grad = grad

    def take(self, param: torch.nn.Parameter, group: GroupRuntime) -> torch.Tensor:
        """The parameter's gradient of this backward, summed into the accumulator (its push is out: the caller
        waited); returns the gradient (for a local step)."""
        if param.grad is None:  # the hook runs after autograd accumulated into .grad
            raise IMergeError(f"parameter of {group}: its gradient hook ran without a gradient")
        grad = param.grad.detach()
        if not self.bucket_views:
            if group.dirty:  # its slice still held the pushed gradient at the forward: clear it before adding
                self.clear(group)
            self.flat.add_grad(param, grad)  # .grad stays this iteration's gradient until the next forward
            return grad
        view = self.views[id(param)]
        if grad.data_ptr() != view.data_ptr():  # autograd accumulated into the view in place, unless...
            stale = group.dirty and id(param) not in group.given  # ...its piece still holds the last push
            if stale or torch.is_grad_enabled():  # (create_graph: .grad became view + gradient, out of place)
                view.copy_(grad.reshape(view.shape))
            else:  # ...its .grad was None at the forward (the script's)
                view.add_(grad.reshape(view.shape))
            param.grad = view
        return grad

    def none_without_gradient(self, group: GroupRuntime) -> None:
        """As after a local backward: a parameter that got no gradient has none."""
        self._set([p for p in group.params if id(p) not in group.given], None)
