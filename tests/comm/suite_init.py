"""``gradcomm.init`` under an MPI launcher, as rank-agnostic tests (the module tier,
:mod:`tests._support.rank_suite`; run by ``tests/comm/test_rank_suites.py`` on its MPI runs of
two ranks or more): launch settings that disagree with MPI, or a setting bad on one rank only,
raise on *every* rank (before init agreed on its settings across ranks, the bad rank raised alone
and the others waited forever in the backend's first MPI collective or the rendezvous through
MPI); a correct placement given on one rank only, or a process-local communicator built on one
rank only, works. Each test builds its own communicators (gloo ones rendezvous through MPI) and
then checks, with an all-reduce on the run's communicator, that the ranks are still in step.

The tests that need MPI not yet initialised, an init that times out, or another launcher keep
their own ``mpiexec`` in ``tests/comm/test_mpi_backend.py``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch

import gradcomm
from gradcomm.comm import Communicator

from tests._support import rank_suite


def _mpi_with_peers(run: rank_suite.Run) -> bool:
    return run.backend == "mpi" and run.world_size >= 2


@contextmanager
def _environment(**changes: str | None) -> Iterator[None]:
    """Set (a str) or remove (None) environment variables; restore them afterwards."""
    saved = {k: os.environ.get(k) for k in changes}
    try:
        for key, value in changes.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _init_outcome(backend: str | None, **kwargs: object) -> str:
    """``gradcomm.init(backend, **kwargs)``: ``"no error"`` (the communicator closed again) or
    ``"<TypeName>: <message>"``."""
    try:
        gradcomm.init(backend, **kwargs).close()  # type: ignore[arg-type]
    except Exception as exc:  # noqa: BLE001 - the test checks type and message
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def _still_in_step(comm: Communicator) -> None:
    n = comm.world_size
    t = torch.tensor([float(comm.rank + 1)])
    comm.all_reduce(t)
    assert t.item() == n * (n + 1) / 2, t


@rank_suite.only(_mpi_with_peers)
@rank_suite.parametrize("case", ["same", "size"])
def test_launch_settings_that_disagree_with_mpi_raise_on_every_rank(comm: Communicator,
                                                                     case: str) -> None:
    # "same": every rank passes rank=0; rank 0's values match MPI's, so it used to wait forever
    # in MPI_Comm_dup for rank 1, which had raised. "size": a world size one too big.
    rank, n = comm.rank, comm.world_size
    explicit = {"same": (0, n), "size": (rank, n + 1)}[case]
    got = _init_outcome("mpi", timeout=10, rank=explicit[0], world_size=explicit[1])
    wrong = f"MPI rank 1 of {n}: explicit settings say rank 0 of {n}" if case == "same" else \
        f"MPI rank 0 of {n}: explicit settings say rank 0 of {n + 1}"
    assert "RuntimeError: the launch settings disagree with MPI" in got, got
    assert wrong in got, got
    _still_in_step(comm)


#: case: (environment variable or None for an argument, the bad value the last rank gets)
BAD_SETTINGS = {
    "profile": ("GRADCOMM_PROFILE", "tru"),
    "abort": ("GRADCOMM_MPI_ABORT_ON_ERROR", "maybe"),
    "cuda_aware": ("GRADCOMM_MPI_CUDA_AWARE", "yes please"),
    "timeout_env": ("GRADCOMM_TIMEOUT", "ten"),
    "backend_env": ("GRADCOMM_BACKEND", "glooo"),
    "timeout_arg": (None, -1.0),
    "device_arg": (None, "tpu"),
    "other_backend": ("GRADCOMM_BACKEND", "other"),  # valid, but not what the others chose
    "device_meta": (None, "meta"),  # a device type the backend does not take
    "env_arg": (None, {"A": 1}),  # not a mapping of str to str
    "timeout_int": (None, 10**400),  # beyond float's range
    "store_one_rank": ("MASTER_ADDR", "127.0.0.1"),  # a store address on one rank only
    "rank_out_of_range": (None, 5),  # explicit rank=5 (with world_size) on one rank only
    "rank_without_size": (None, "x"),  # explicit rank alone on one rank only
    "placement_with_store": (None, 0),  # rank=0 on the last rank, a store address everywhere
    "debug_env": ("GRADCOMM_DEBUG", "verbose"),
    "other_debug": ("GRADCOMM_DEBUG", "detail"),  # valid, but its checks would pair with data
}


def _says(case: str, n: int) -> str:
    """What every rank's message of ``case`` must contain, at ``n`` ranks."""
    return {
        "profile": "GRADCOMM_PROFILE must be one of",
        "abort": "GRADCOMM_MPI_ABORT_ON_ERROR must be one of",
        "cuda_aware": "GRADCOMM_MPI_CUDA_AWARE must be one of",
        "timeout_env": "GRADCOMM_TIMEOUT must be a number of seconds",
        "backend_env": "glooo",
        "timeout_arg": "timeout must be a positive, finite number",
        "device_arg": "device 'tpu' is not a torch device",
        "other_backend": "the ranks chose different backends",
        "device_meta": "backend works on c",
        "env_arg": "env must be a mapping of str to str",
        "timeout_int": "timeout must be a positive, finite number",
        "store_one_rank": "the ranks chose different store addresses",
        "rank_out_of_range": "rank must be in [0, ",
        "rank_without_size": "give rank and world_size together",
        "placement_with_store": f"the launch settings disagree with MPI on 1 of {n} ranks",
        "debug_env": "GRADCOMM_DEBUG must be 'off' or 'detail' (any case), got 'verbose'",
        "other_debug": "the ranks chose different debug levels",
    }[case]


_RAISED_AS = {"env_arg": "TypeError", "placement_with_store": "RuntimeError"}  # else ValueError
#: cases where every rank's message is the agreement's own (not "init failed on rank ...")
_AGREED = ("other_backend", "store_one_rank", "placement_with_store", "other_debug")


@rank_suite.only(_mpi_with_peers)
@rank_suite.parametrize(
    "backend_case",
    # the mpi backend uses no store: a MASTER_ADDR on one rank is harmless there
    [(b, c) for b in ("mpi", "gloo") for c in sorted(BAD_SETTINGS)
     if (b, c) != ("mpi", "store_one_rank")],
    ids=[f"{b}-{c}" for b in ("mpi", "gloo") for c in sorted(BAD_SETTINGS)
         if (b, c) != ("mpi", "store_one_rank")])
def test_a_setting_bad_on_one_rank_raises_on_every_rank(comm: Communicator,
                                                        backend_case: tuple[str, str]) -> None:
    # Each case hung until killed before init agreed on its settings across MPI ranks (the store
    # case: until the store's timeout). The last rank gets the bad value.
    backend, case = backend_case
    rank, n = comm.rank, comm.world_size
    last = rank == n - 1
    var, bad = BAD_SETTINGS[case]
    # the timeout argument would win over GRADCOMM_TIMEOUT
    kwargs: dict[str, object] = {} if case == "timeout_env" else {"timeout": 30.0}
    chosen: str | None = backend
    env: dict[str, str | None] = {"GRADCOMM_BACKEND": None, "MASTER_ADDR": None,
                                  "MASTER_PORT": None}
    if var is not None:
        env.setdefault(var, None)
    if last:
        if case == "other_backend":
            env["GRADCOMM_BACKEND"] = "gloo" if backend == "mpi" else "mpi"
            chosen = None
        elif case == "backend_env":
            env["GRADCOMM_BACKEND"] = str(bad)
            chosen = None
        elif var is not None:
            env[var] = str(bad)
        elif case in ("timeout_arg", "timeout_int"):
            kwargs["timeout"] = bad
        elif case == "env_arg":
            kwargs["env"] = bad
        elif case == "rank_out_of_range":
            kwargs["rank"], kwargs["world_size"] = bad, n
        elif case == "rank_without_size":
            kwargs["rank"] = bad
        elif case == "placement_with_store":
            kwargs["rank"], kwargs["world_size"] = bad, n
        else:
            kwargs["device"] = bad
        if case == "store_one_rank":
            env["MASTER_PORT"] = "29517"
    if case == "placement_with_store":  # the store was trusted: a TCPStore timeout, 2x later
        env["MASTER_ADDR"], env["MASTER_PORT"] = "127.0.0.1", "29518"
    with _environment(**env):
        got = _init_outcome(chosen, **kwargs)
    kind = _RAISED_AS.get(case, "ValueError")
    assert f"{kind}: " in got and _says(case, n) in got, got
    if case not in _AGREED and not last:  # the others name the rank that had the problem
        assert f"gradcomm.init failed on 1 of {n} ranks (rank {n - 1}: {kind}:" in got, got
    _still_in_step(comm)


@rank_suite.only(_mpi_with_peers)
def test_a_process_local_communicator_on_one_rank_does_not_wait_for_the_others(
        comm: Communicator) -> None:
    # rank 0 alone builds one (rank=0, world_size=1): an agreement across the job would wait
    # forever for ranks that never call init
    if comm.rank == 0:
        with gradcomm.init("gloo", rank=0, world_size=1, timeout=30) as local:
            t = torch.ones(2)
            local.all_reduce(t)
            assert t.tolist() == [1.0, 1.0] and local.world_size == 1
    _still_in_step(comm)


@rank_suite.only(_mpi_with_peers)
@rank_suite.parametrize("backend", ["mpi", "gloo"])
def test_a_correct_placement_given_on_one_rank_only_still_works(comm: Communicator,
                                                                backend: str) -> None:
    # the rank with rank=/world_size= used to skip the settings check while the others ran it:
    # their collectives paired with the wrong ones (IndexError/ValueError on mpi, a hang on gloo)
    rank, n = comm.rank, comm.world_size
    placement = {"rank": rank, "world_size": n} if rank == n - 1 else {}
    with _environment(GRADCOMM_BACKEND=None, MASTER_ADDR=None, MASTER_PORT=None), \
            gradcomm.init(backend, timeout=30, **placement) as other:  # type: ignore[arg-type]
        assert (other.rank, other.world_size) == (rank, n)
        t = torch.full((2,), float(rank + 1))
        other.all_reduce(t)
        assert t.tolist() == [n * (n + 1) / 2] * 2, t
    _still_in_step(comm)
