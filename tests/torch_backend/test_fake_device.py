"""A "gradcomm" group with a transport per device type, through the fake-device harness (a CPU
transport under a communicator on a non-CPU device, tensors that report that device): tensors go
to their device type's communicator, and device tensors give the CPU's values bit for bit.

What a CPU machine cannot show: the harness's device is ``meta``, so DDP's and FSDP2's own
buffers (allocated by torch in C++) and buffers the group allocates on its engine thread (the
list forms of all_gather, all_to_all, gather, scatter) are real meta tensors without data; those
run on CPU tensors in the other tests and on CUDA in docs/torch-backend.md's device check.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import torch

from gradcomm.comm.backends.threads import ThreadGroup
from gradcomm.torch_backend import ProcessGroupGradcomm

from tests._support.fake_device import FakeDeviceCommunicator, fake_device, to_cpu, to_fake

N = 2


def _body(g: ProcessGroupGradcomm, r: int, device: bool) -> list[torch.Tensor]:
    def put(t: torch.Tensor) -> torch.Tensor:
        return to_fake(t) if device else t

    gen = torch.Generator().manual_seed(r)
    x = put(torch.randn(6, generator=gen))
    g.allreduce([x]).wait()
    b = put(torch.full((3,), float(r)))
    g.broadcast([b]).wait()
    out = put(torch.empty(N * 4))
    g.all_gather_single(out, put(torch.randn(4, generator=gen))).wait()
    rs = put(torch.empty(2))
    g.reduce_scatter_single(rs, put(torch.randn(2 * N, generator=gen))).wait()
    a2a = put(torch.empty(N * 2))
    g.all_to_all_single(a2a, put(torch.randn(N * 2, generator=gen)), [], []).wait()
    return [to_cpu(t) for t in (x, b, out, rs, a2a)]  # the harness has no send/recv


def test_device_tensors_use_their_transport_and_match_the_cpu() -> None:
    cpu, device = ThreadGroup(N, timeout=20), ThreadGroup(N, timeout=20)
    groups = [ProcessGroupGradcomm(r, N, {"cpu": cpu.communicator(r),
                                          "meta": FakeDeviceCommunicator(device.communicator(r))},
                                   f"fake{r}", 20.0) for r in range(N)]

    def run(r: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        with fake_device():
            return _body(groups[r], r, True), _body(groups[r], r, False)

    try:
        with ThreadPoolExecutor(N) as pool:
            results = list(pool.map(run, range(N), timeout=60))
    finally:
        for g in groups:
            g.shutdown()
    for on_device, on_cpu in results:
        for a, b in zip(on_device, on_cpu, strict=True):
            assert torch.equal(a, b)
