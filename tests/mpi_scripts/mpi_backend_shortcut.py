"""Run under ``mpiexec -n 2``: the mpi all_reduce shortcut and its fallbacks.

The shortcut posts the common call (SUM of a contiguous CPU tensor of a natively reduced dtype,
already classified, nothing pending, no profiler) with the base class's checks read from their
cache and the backend hook's direct ``Iallreduce``, without the general path (the base class's
``_checked_all_reduce`` or the hook's ``_post_all_reduce``). This script counts the general path's
calls (by wrapping those methods) and checks, for the shortcut and for each condition that must
send a call down the general path, that the values are exact, that the work's description is the
general path's, and which path ran. Exits non-zero on any difference; prints ``RESULT shortcut ok
rank=<r> checks=<n>``.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch

import gradcomm
from gradcomm.comm.backends.mpi.communicator import MPICommunicator
from gradcomm.comm.communicator import Communicator
from gradcomm.profiler import profile

general_calls = 0
# The general path: the base class's full checks, or the backend hook's general posting.
_general = Communicator._checked_all_reduce
_general_post = MPICommunicator._post_all_reduce


def _counting(self: Communicator, *args: Any, **kwargs: Any) -> Any:
    global general_calls
    general_calls += 1
    return _general(self, *args, **kwargs)


def _counting_post(self: MPICommunicator, *args: Any, **kwargs: Any) -> Any:
    global general_calls
    general_calls += 1
    return _general_post(self, *args, **kwargs)


Communicator._checked_all_reduce = _counting  # type: ignore[method-assign]
MPICommunicator._post_all_reduce = _counting_post  # type: ignore[method-assign]


def main() -> None:
    comm = gradcomm.init("mpi", timeout=30)
    r, n = comm.rank, comm.world_size
    checks = 0

    def check(name: str, run: Callable[[], torch.Tensor], want: torch.Tensor,
              general: bool) -> None:
        nonlocal checks
        before = general_calls
        got = run()
        took_general = general_calls > before
        if took_general != general:
            sys.exit(f"rank {r}: {name}: general path {took_general}, expected {general}")
        if got.dtype != want.dtype or not torch.equal(got, want):
            sys.exit(f"rank {r}: {name}: got {got}, want {want}")
        checks += 1

    def reduced(t: torch.Tensor, **kw: Any) -> torch.Tensor:
        comm.all_reduce(t, **kw)
        return t

    base = torch.arange(6, dtype=torch.float32) + 10 * r
    total = sum(torch.arange(6, dtype=torch.float32) + 10 * k for k in range(n))
    # The first float32 call classifies (dtype, device) on the general path; later ones shortcut.
    check("first call", lambda: reduced(base.clone()), total, general=True)
    check("shortcut", lambda: reduced(base.clone()), total, general=False)
    check("shortcut, 2-D", lambda: reduced(base.clone().view(2, 3)), total.view(2, 3), False)
    check("shortcut, offset view", lambda: reduced(torch.cat([base, base])[6:]), total, False)

    # The work of a shortcut call reads like the general path's.
    t = base.clone()
    work = comm.all_reduce(t, label="metrics")
    text = work.description
    if not (text.startswith("all_reduce #") and " SUM metrics of 6 torch.float32 on cpu (mpi, rank "
                                                f"{r}/{n})" in text):
        sys.exit(f"rank {r}: shortcut description {text!r}")
    checks += 1

    # async: pending until waited; a call while it is pending takes the general path.
    a, b = base.clone(), base.clone()
    wa = comm.all_reduce(a, async_op=True)
    check("while one is pending", lambda: reduced(b), total, general=True)
    wa.wait()
    check("async result", lambda: a, total, general=False)

    # Every condition outside the shortcut goes down the general path, with the same values.
    check("op by name", lambda: reduced(base.clone(), op="sum"), total, general=True)
    check("MAX", lambda: reduced(base.clone(), op=gradcomm.ReduceOp.MAX),
          torch.arange(6, dtype=torch.float32) + 10 * (n - 1), general=True)
    check("AVG", lambda: reduced(base.clone(), op="avg"), total / n, general=True)
    strided = torch.stack([base, base], dim=1)[:, 0]  # non-contiguous
    check("non-contiguous", lambda: reduced(strided), total, general=True)
    neg_src = torch.complex(base, -base)
    neg = neg_src.conj().imag  # a lazy negative view: its values are +base
    if not neg.is_neg():
        sys.exit(f"rank {r}: expected a negative view")
    check("negative view", lambda: reduced(neg), total, general=True)
    flags = torch.tensor([r == 0, False])
    check("bool (SUM is logical or)", lambda: reduced(flags), torch.tensor([True, False]), True)
    for dtype in (torch.float64, torch.int64):  # first call classifies, the second shortcuts
        want = total.to(dtype)
        check(f"{dtype} first", lambda d=dtype: reduced(base.to(d)), want, general=True)
        check(f"{dtype} again", lambda d=dtype: reduced(base.to(d)), want, general=False)
    check("float16", lambda: reduced(base.half()), total.half(), general=True)
    check("empty", lambda: reduced(torch.zeros(0)), torch.zeros(0), general=True)
    with profile(comm) as prof:
        check("profiled", lambda: reduced(base.clone()), total, general=True)
    if len(prof.records) != 1:
        sys.exit(f"rank {r}: the profiler saw {len(prof.records)} collectives, expected 1")
    check("after the profiler", lambda: reduced(base.clone()), total, general=False)

    # Bad input still raises the general path's errors, on every rank.
    for bad, kind in ((torch.zeros(3, device="meta"), ValueError),
                      (torch.zeros(3).to_sparse(), TypeError)):
        try:
            comm.all_reduce(bad)
        except kind:
            checks += 1
        else:
            sys.exit(f"rank {r}: all_reduce({bad.device}, {bad.layout}) did not raise {kind}")
    for kwargs in ({"async_op": "no"}, {"label": 5}):  # not the shortcut: the general path's check
        try:
            comm.all_reduce(base.clone(), **kwargs)  # type: ignore[arg-type]
        except TypeError:
            checks += 1
        else:
            sys.exit(f"rank {r}: all_reduce(..., {kwargs}) did not raise TypeError")
    comm.close()
    try:
        comm.all_reduce(base.clone())
    except RuntimeError as exc:
        if "closed" not in str(exc):
            sys.exit(f"rank {r}: closed communicator raised {exc!r}")
        checks += 1
    else:
        sys.exit(f"rank {r}: a closed communicator reduced")
    print(f"RESULT shortcut ok rank={r} checks={checks}", flush=True)


if __name__ == "__main__":
    main()
