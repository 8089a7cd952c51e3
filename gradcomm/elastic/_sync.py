"""State transfer at a re-formation: every member ends with the state of the most advanced one.

After a failure the survivors may stand at two step counts: a collective can complete on some
ranks and fail on others, so some applied step ``s`` and some did not. Every rank that applied it
holds the same values (it received the full average), so the rule is: the lowest rank with the
most applied steps is the source, and, when any member differs from it (or has no state yet: a
joining worker, or every worker at the first formation), every member receives the source's
model parameters and buffers (broadcast, tensor by tensor, on the communicator's device), its
optimizer state and its ``extra`` values (pickled). Nothing is read from a file. A member that
dies meanwhile makes a collective fail: the group forms again without it, and another member
serves.

A :class:`~gradcomm.ShardedOptimizer` is the exception: each rank holds the only copy of its
shard of the optimizer state, which dies with the rank. Its full state is therefore kept as a
*snapshot* in every worker's host memory (:func:`take_snapshot`: the optimizer's collective
``state_dict()``, the model's ``state_dict()`` and the ``extra`` values, every
``snapshot_every`` steps). When any member holds a snapshot, the re-formation returns every
member to the newest snapshot a member holds (:func:`send_snapshot`): the steps since are done
again, over the new membership.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from ..comm import Communicator
from .state import State

__all__ = ["Source", "agree_on_source", "load_snapshot", "send_extra", "send_model",
           "send_optimizer", "send_snapshot", "take_snapshot"]


class Source:
    """Who serves the state, and whether anyone needs it.

    Attributes:
        rank: the lowest rank with the most applied steps (with snapshots: the newest snapshot).
        step: its step count (with snapshots: the snapshot's).
        needed: some member's state differs from the source's.
        snapshot: some member holds a snapshot (a sharded optimizer): restore the newest.
    """

    def __init__(self, rank: int, step: int, needed: bool, snapshot: bool) -> None:
        self.rank, self.step, self.needed, self.snapshot = rank, step, needed, snapshot


def agree_on_source(comm: Communicator, state: State) -> Source:
    """All-gather every member's step count (-1: no state yet) and snapshot step (-1: none),
    and pick the source."""
    snap = -1 if state.snapshot is None else int(state.snapshot["step"])
    mine = torch.tensor([state.step if state.synced else -1, snap], dtype=torch.int64,
                        device=comm.device)
    every = torch.empty(2 * comm.world_size, dtype=torch.int64, device=comm.device)
    comm.all_gather(every, mine)
    steps, snaps = every.cpu().view(-1, 2).t().tolist()
    if max(snaps) >= 0:
        best = max(snaps)
        return Source(snaps.index(best), best, True, True)
    best = max(steps)
    needed = best < 0 or any(s != best for s in steps)
    return Source(steps.index(best), max(best, 0), needed, False)


def _to_host(value: Any) -> Any:
    """``value`` with every tensor in it copied to the host (a state_dict is live)."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {k: _to_host(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to_host(v) for v in value)
    return value


def take_snapshot(state: State) -> dict[str, Any]:
    """The full state at ``state.step`` in host memory: the model's and the optimizer's
    ``state_dict()`` (a ShardedOptimizer's is a collective: every member calls this at the same
    step) and the ``extra`` values."""
    assert state.optimizer is not None
    return {"step": state.step, "model": _to_host(state.model.state_dict()),
            "optimizer": _to_host(state.optimizer.state_dict()),
            "extra": {k: _to_host(v.state_dict()) if hasattr(v, "state_dict")
                      else copy.deepcopy(v) for k, v in state.extra.items()}}


def send_snapshot(comm: Communicator, state: State, src: int) -> None:
    """Give every member rank ``src``'s snapshot (pickled) and return the model, the ``extra``
    values and the step count to it; the optimizer's part is loaded by :func:`load_snapshot`
    once ``build`` made the optimizer."""
    snapshot = comm.broadcast_object(state.snapshot if comm.rank == src else None, src)
    assert isinstance(snapshot, dict)
    state.snapshot = snapshot
    state.model.load_state_dict(snapshot["model"])
    _load_extra(state.extra, snapshot["extra"])
    state.step = int(snapshot["step"])


def load_snapshot(state: State) -> None:
    """Load the snapshot's optimizer state into ``state.optimizer`` (on every member)."""
    assert state.snapshot is not None and state.optimizer is not None
    state.optimizer.load_state_dict(state.snapshot["optimizer"])


def _tensors(model: torch.nn.Module) -> list[torch.Tensor]:
    """Parameters then buffers, each once (tied ones once), in registration order."""
    seen: set[int] = set()
    out = []
    for t in [*model.parameters(), *model.buffers()]:
        if id(t) not in seen:
            seen.add(id(t))
            out.append(t.detach())
    return out


def send_model(comm: Communicator, model: torch.nn.Module, src: int) -> None:
    """Broadcast ``model``'s parameters and buffers from rank ``src``, in place."""
    works = [comm.broadcast(t, src, async_op=True) for t in _tensors(model) if t.numel()]
    for work in works:
        work.wait()


def send_optimizer(comm: Communicator, optimizer: torch.optim.Optimizer | None, src: int) -> None:
    """Send an (unsharded) optimizer's ``state_dict()`` from rank ``src`` (pickled, its tensors
    through the host); the others load it (torch moves the tensors to each parameter's device)."""
    if optimizer is None:
        return
    sent = comm.broadcast_object(_to_host(optimizer.state_dict()) if comm.rank == src else None,
                                 src)
    if comm.rank != src:
        optimizer.load_state_dict(sent)  # type: ignore[arg-type]  # the source's state_dict


def send_extra(comm: Communicator, extra: dict[str, Any], src: int) -> None:
    """Send the ``extra`` values from rank ``src``: objects with ``load_state_dict`` load the
    source's ``state_dict()``, other values are replaced."""
    mine = {k: _to_host(v.state_dict()) if hasattr(v, "state_dict") else v
            for k, v in extra.items()} if comm.rank == src else None
    sent = comm.broadcast_object(mine, src)
    if comm.rank != src and isinstance(sent, dict):
        _load_extra(extra, sent)


def _load_extra(extra: dict[str, Any], sent: dict[str, Any]) -> None:
    for key, value in sent.items():
        target = extra.get(key)
        if target is not None and hasattr(target, "load_state_dict"):
            target.load_state_dict(value)
        else:
            extra[key] = value
