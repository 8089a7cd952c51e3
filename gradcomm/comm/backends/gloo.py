"""The gloo backend: CPU tensors over torch.distributed's gloo process group.

Capability table (CPU):

============================  ==============  ==========================================
dtype                         support         note
============================  ==============  ==========================================
float32, float64              native
int8, uint8, int32, int64     native
float16, bfloat16             emulated-slow   gloo reduces 16-bit floats element by element
                                              with conversions; SlowPathWarning
ReduceOp.AVG                  emulated        gloo has no average: SUM, then divide
other dtypes, CUDA tensors    unsupported     TypeError / ValueError
============================  ==============  ==========================================
"""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

from ..launch.launcher import LaunchInfo, cpus_per_local_process
from ..types import Support, SupportLevel
from .torch_dist import TorchDistCommunicator

__all__ = ["GlooCommunicator"]

_NATIVE = {torch.float32, torch.float64, torch.int8, torch.uint8, torch.int32, torch.int64,
           torch.bool}
_SLOW = {torch.float16, torch.bfloat16}


class GlooCommunicator(TorchDistCommunicator):
    """Collectives on CPU tensors through a gloo process group of gradcomm's own.

    Args:
        launch: rank, world size and local rank (see :func:`gradcomm.comm.detect_launch`).
        timeout: seconds per collective (and for the rendezvous); ``None``: a day.

    Network (ranks on several hosts): gloo binds the address this rank reached the store from
    (:attr:`bind_address`), unless ``GLOO_SOCKET_IFNAME`` is set, which then wins.

    Raises:
        RuntimeError: torch was built without gloo, or the rendezvous failed (on every rank
            when no address reaches every rank).
    """

    backend = "gloo"
    interface_variable = "GLOO_SOCKET_IFNAME"
    receives_from_any_source = True  # ProcessGroupGloo.recv_anysource
    transfer_waits_sliced = False  # a gloo transfer fails when a timed wait elapses

    def __init__(self, launch: LaunchInfo, *, timeout: float | None = 300.0) -> None:
        if not dist.is_available() or not dist.is_gloo_available():
            raise RuntimeError(
                "this torch build has no gloo support "
                "(torch.distributed.is_gloo_available() is False)"
            )
        super().__init__(launch, device=torch.device("cpu"), timeout=timeout)

    def _make_group(
        self, store: dist.Store, launch: LaunchInfo, timeout: float | None
    ) -> dist.ProcessGroup:
        td = datetime.timedelta(seconds=86400 if timeout is None else timeout)
        if self.bind_address is None or os.environ.get("GLOO_SOCKET_IFNAME", "").strip():
            # One host (gloo's default works there), or the user's interface, which this
            # constructor reads from GLOO_SOCKET_IFNAME itself.
            group = dist.ProcessGroupGloo(store, launch.rank, launch.world_size, td)
        else:
            # Bound to the address this rank reached the others from: gloo's default device
            # binds the hostname's address, 127.0.1.1 on Debian. create_device is public, but
            # torch has no public way to hand a device to the group (init_process_group and
            # new_group take none for gloo): _Options and its fields are private, and the only way.
            opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # not in stubs
            opts._timeout = td
            opts._devices = [dist.ProcessGroupGloo.create_device(hostname=self.bind_address)]
            group = dist.ProcessGroupGloo(store, launch.rank, launch.world_size, opts)
        # gloo's connect is not a barrier: a rank may finish it while a peer still completes its
        # side, and a rank that closes the group at once (split, then close) would fail that
        # peer's connect ("Connection closed by peer"). No rank returns before every rank has.
        group.barrier().wait()  # type: ignore[attr-defined]  # stubs say Backend has none
        return group  # type: ignore[return-value]  # stubs say Backend; the methods are the same

    @property
    def background_progress(self) -> bool:
        """True when each process on this host has >= 2 CPU cores: one for gloo's worker thread."""
        return cpus_per_local_process(self.launch.local_world_size) >= 2

    def _supports(self, dtype: torch.dtype, device: torch.device | str | None) -> Support:
        dev = self.device if device is None else torch.device(device)
        if dev.type != "cpu":
            return Support(
                SupportLevel.UNSUPPORTED,
                f"the gloo backend here reduces CPU tensors, not {dev.type}",
            )
        if dtype in _NATIVE:
            return Support(SupportLevel.NATIVE, "", dtype)
        if dtype in _SLOW:
            return Support(
                SupportLevel.EMULATED_SLOW,
                f"gloo reduces {dtype} on the CPU element by element with conversions (slow)",
                dtype,
            )
        return Support(SupportLevel.UNSUPPORTED, f"the gloo backend cannot reduce {dtype}")
