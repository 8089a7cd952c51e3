"""One worker of the fault-tolerance tests (a process of its own, started by the test).

    python -m tests._support.elastic_worker --coordinator HOST:PORT --out FILE [--fault KIND@STEP]

Trains :mod:`elastic_case`'s model under :class:`gradcomm.elastic.ElasticGroup` and, with
``--fault``, does to itself at that step what a real fault does (SIGKILL cannot be caught, so
the process dies as under ``kill -9``):

- ``forward``: SIGKILL in the middle of the forward pass;
- ``backward``: SIGKILL in backward once the later layers' buckets are in flight;
- ``optimizer``: SIGKILL inside ``optimizer.step()`` (with ``--zero``: after this rank's shard
  was updated, while the others wait in the parameters' all-gather);
- ``stall``: SIGSTOP in the middle of the forward pass (the test kills it later);
- ``serve``: SIGKILL after the first tensor it sends to a joining worker (the first worker of
  the job to serve one; ``STEP`` is ignored).

With ``--zero 1|2`` the optimizer is a ShardedOptimizer, built over each communicator. With
``--hook-state`` the reducer sums its buckets through a comm hook whose state holds the
communicator it was built over (as PowerSGD's does), made anew by ``build`` at each formation;
the output lists, per state, the generation it served and the buckets it summed.
With ``--fake-device`` the model, its data and every collective live on the fake device of
tests/_support/fake_device.py, over a gloo communicator (as an nccl or cupy-nccl communicator
holds CUDA tensors): the re-formations and the state sent to joiners then run on a non-CPU
device.

After each step it sets ``test/step`` on the coordinator (the test starts joiners by it). With
``--hold STEP`` it waits inside step ``STEP``, between forward and backward, until its
generation ends (a joiner arrives during that step, or a member fails). At the end it writes
``FILE`` (torch.save): the parameters, the step count, the generations it trained in
(``(number, world size, seconds the formation took)``), and the ElasticError it raised (or None).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import logging
import os
import signal
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import gradcomm
from gradcomm import elastic
from gradcomm.comm import LaunchInfo, ReduceOp, Work
from gradcomm.comm.backends.gloo import GlooCommunicator
from gradcomm.elastic import _formation

from tests._support import elastic_case
from tests._support.fake_device import (
    FakeDeviceCommunicator,
    fake_device,
    to_cpu,
    to_fake,
    to_fake_module,
)

STEP_KEY = "test/step"


def die(sig: int = signal.SIGKILL) -> None:
    os.kill(os.getpid(), sig)


class AbortableFakeDevice(FakeDeviceCommunicator):
    """The fake-device communicator, aborted as its gloo transport is."""

    def abort(self) -> None:
        self.inner.abort()


def fake_device_gloo(launch: LaunchInfo, timeout: float,
                     device: torch.device | None) -> gradcomm.Communicator:
    """ElasticGroup's communicator factory: fake-device tensors over gloo (over
    ``launch.store``)."""
    return AbortableFakeDevice(GlooCommunicator(launch, timeout=timeout))


class HookState:
    """A comm hook's state bound to one communicator: a hook still holding an aborted one would
    fail every step after a re-formation."""

    def __init__(self, comm: gradcomm.Communicator, generation: int) -> None:
        self.comm, self.generation, self.calls = comm, generation, 0


def stateful_hook(state: HookState, bucket: gradcomm.hooks.GradBucket) -> Work:
    state.calls += 1
    return state.comm.all_reduce(bucket.buffer(), ReduceOp.SUM, async_op=True)


def at_step(current: dict[str, int], step: int, sig: int = signal.SIGKILL) -> Any:
    """A hook (any arguments, returns None) that sends ``sig`` to this process at ``step``."""
    def hook(*_: object) -> None:
        if current["step"] == step:
            die(sig)
    return hook


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--coordinator", required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--fault", default="none@0")
    p.add_argument("--min-world-size", type=int, default=2)
    p.add_argument("--world-size", type=int, default=4)
    p.add_argument("--timeout", type=float, default=5.0)
    p.add_argument("--heartbeat-timeout", type=float, default=1.0)
    p.add_argument("--join-timeout", type=float, default=20.0)
    p.add_argument("--hold", type=int, default=-1)
    p.add_argument("--fake-device", action="store_true")
    p.add_argument("--zero", type=int, default=0, choices=(0, 1, 2))
    p.add_argument("--hook-state", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format="%(asctime)s %(process)d %(name)s: %(message)s")
    kind, _, at = args.fault.partition("@")
    fault_step = int(at or 0)
    host, port = args.coordinator.rsplit(":", 1)
    test_store = dist.TCPStore(host, int(port), is_master=False, wait_for_workers=False,
                               timeout=datetime.timedelta(seconds=30))

    model = elastic_case.make_model()
    if args.fake_device:
        to_fake_module(model)
    opt = elastic_case.make_optimizer(model)
    state = elastic.State(model, None if args.zero else opt)
    current = {"step": -1}
    generations: list[tuple[int, int, float | None]] = []
    hook_states: list[HookState] = []

    def build(comm: gradcomm.Communicator, st: elastic.State) -> gradcomm.GradientReducer:
        reducer = gradcomm.GradientReducer(st.model, comm, bucket_cap_mb=elastic_case.BUCKET_CAP_MB,
                                           first_bucket_cap_mb=elastic_case.BUCKET_CAP_MB)
        if args.hook_state:
            hook_states.append(HookState(comm, group.generation))
            reducer.register_comm_hook(stateful_hook, state=hook_states[-1])
        if args.zero:
            st.optimizer = gradcomm.ShardedOptimizer(reducer, torch.optim.SGD, stage=args.zero,
                                                     **elastic_case.OPTIMIZER)
            if kind == "optimizer":  # after its shard's update, before the all-gather
                st.optimizer.optim.register_step_post_hook(at_step(current, fault_step))
        if kind == "backward":  # the first layer's weight is the last gradient of backward
            st.model[0].weight.register_post_accumulate_grad_hook(at_step(current, fault_step))
        return reducer

    if kind == "forward":
        model[2].register_forward_pre_hook(at_step(current, fault_step))
    if kind == "stall":
        model[2].register_forward_pre_hook(at_step(current, fault_step, signal.SIGSTOP))
    if kind == "optimizer" and not args.zero:
        opt.register_step_pre_hook(at_step(current, fault_step))
    if kind == "serve":
        real = _formation.send_model

        def serve_then_die(comm: gradcomm.Communicator, module: torch.nn.Module, src: int) -> None:
            first = next(module.parameters()).detach()
            me = str(os.getpid()).encode()
            if (comm.rank == src and state.synced
                    and test_store.compare_set("test/served", "", me) == me):
                comm.broadcast(first, src)
                die()
            real(comm, module, src)

        _formation.send_model = serve_then_die  # type: ignore[assignment]

    result: dict[str, Any] = {"error": None}
    device = fake_device() if args.fake_device else contextlib.nullcontext()
    to = to_fake if args.fake_device else (lambda t: t)
    group = elastic.ElasticGroup(
        state, build, coordinator=args.coordinator,
        backend=fake_device_gloo if args.fake_device else "gloo",
        min_world_size=args.min_world_size, world_size=args.world_size, timeout=args.timeout,
        heartbeat_timeout=args.heartbeat_timeout, join_timeout=args.join_timeout,
        job_id="test")

    def hold_until_the_generation_ends() -> None:
        # Set by the monitor thread once the generation's end key appears and it aborted the
        # communicator: this step's backward then fails (a private flag, for the test only).
        assert group._formation.ended.wait(60), "the generation did not end"

    try:
        with device:
            for step in group.steps(args.steps):
                with step as comm:
                    current["step"] = step.index
                    optimizer = state.optimizer  # a new one per generation with --zero
                    assert optimizer is not None
                    optimizer.zero_grad()
                    loss = elastic_case.shard_loss(model, step.index, comm.rank,
                                                   comm.world_size, to)
                    if step.index == args.hold:  # once
                        args.hold = -1
                        hold_until_the_generation_ends()
                    loss.backward()
                    optimizer.step()
                if not generations or generations[-1][0] != group.generation:
                    generations.append((group.generation, group.world_size,
                                        group.last_formation_s))
                test_store.set(STEP_KEY, str(state.step))
    except elastic.ElasticError as exc:
        result["error"] = str(exc)
    finally:
        group.close()
    result.update(params=[to_cpu(p) for p in model.parameters()], step=state.step,
                  generations=generations,
                  hook_states=[(h.generation, h.comm.world_size, h.calls) for h in hook_states])
    torch.save(result, args.out)
    return 3 if result["error"] else 0


if __name__ == "__main__":
    sys.exit(main())
