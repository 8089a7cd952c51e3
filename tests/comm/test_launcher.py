"""Launch detection: each launcher's variables map to rank, world size, local rank and launcher."""

from __future__ import annotations

import os

import pytest

from gradcomm.comm import Launcher, LaunchInfo, detect_launch
from gradcomm.comm.launch.launcher import check_launch_matches_mpi, cpus_per_local_process

# (id, environment, expected (rank, world_size, local_rank, local_world_size, launcher))
CASES: list[tuple[str, dict[str, str], tuple[int, int, int, int, Launcher]]] = [
    (
        "torchrun",
        {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"},
        (3, 4, 1, 2, Launcher.TORCHRUN),
    ),
    (
        "open-mpi",
        {
            "OMPI_COMM_WORLD_RANK": "5",
            "OMPI_COMM_WORLD_SIZE": "8",
            "OMPI_COMM_WORLD_LOCAL_RANK": "1",
            "OMPI_COMM_WORLD_LOCAL_SIZE": "4",
        },
        (5, 8, 1, 4, Launcher.OPEN_MPI),
    ),
    (
        "mpich-hydra",  # what `mpiexec -n 2` of pip's mpich sets (checked on this machine)
        {"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2",
         "PMI_FD": "9"},
        (1, 2, 1, 2, Launcher.MPICH),
    ),
    (
        "intel-mpi",  # Intel MPI's Hydra: the same PMI_* / MPI_LOCAL* names, two hosts
        {"PMI_RANK": "6", "PMI_SIZE": "8", "MPI_LOCALRANKID": "2", "MPI_LOCALNRANKS": "4",
         "I_MPI_ROOT": "/opt/intel/mpi"},
        (6, 8, 2, 4, Launcher.MPICH),
    ),
    (
        "pmix-own-vars",
        {"PMIX_RANK": "2", "PMIX_SIZE": "4", "PMIX_LOCAL_RANK": "0", "PMIX_LOCAL_SIZE": "2"},
        (2, 4, 0, 2, Launcher.PMIX),
    ),
    (
        "pmix-under-srun",  # srun --mpi=pmix: PMIX_RANK plus SLURM's sizes
        {"PMIX_RANK": "3", "SLURM_NTASKS": "4", "SLURM_LOCALID": "1",
         "SLURM_NTASKS_PER_NODE": "2", "SLURM_PROCID": "3"},
        (3, 4, 1, 2, Launcher.PMIX),
    ),
    (
        "mvapich2",
        {
            "MV2_COMM_WORLD_RANK": "7",
            "MV2_COMM_WORLD_SIZE": "16",
            "MV2_COMM_WORLD_LOCAL_RANK": "3",
            "MV2_COMM_WORLD_LOCAL_SIZE": "8",
        },
        (7, 16, 3, 8, Launcher.MVAPICH2),
    ),
    (
        "slurm-ntasks-per-node",
        {"SLURM_PROCID": "4", "SLURM_NTASKS": "6", "SLURM_LOCALID": "1",
         "SLURM_NTASKS_PER_NODE": "3"},
        (4, 6, 1, 3, Launcher.SLURM),
    ),
    (
        "slurm-tasks-per-node-repeat",  # "2(x3)": 2 tasks on each of 3 nodes
        {"SLURM_PROCID": "5", "SLURM_NTASKS": "6", "SLURM_LOCALID": "1",
         "SLURM_TASKS_PER_NODE": "2(x3)"},
        (5, 6, 1, 2, Launcher.SLURM),
    ),
    (
        "slurm-tasks-per-node-list",  # "4(x2),1": first field is this job's usual count
        {"SLURM_PROCID": "0", "SLURM_NTASKS": "9", "SLURM_LOCALID": "0",
         "SLURM_TASKS_PER_NODE": "4(x2),1"},
        (0, 9, 0, 4, Launcher.SLURM),
    ),
    (
        "torchrun-without-local-vars",  # no local info: all ranks on one host
        {"RANK": "1", "WORLD_SIZE": "3"},
        (1, 3, 1, 3, Launcher.TORCHRUN),
    ),
    (
        "local-rank-without-local-size",  # e.g. an older Hydra: MPI_LOCALRANKID alone
        {"PMI_RANK": "3", "PMI_SIZE": "4", "MPI_LOCALRANKID": "1"},
        (3, 4, 1, 4, Launcher.MPICH),
    ),
    (
        "torchrun-without-local-world-size",  # two nodes of two: the local rank is kept
        {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1"},
        (3, 4, 1, 4, Launcher.TORCHRUN),
    ),
    ("single", {"PATH": "/usr/bin", "HOME": "/root"}, (0, 1, 0, 1, Launcher.SINGLE)),
    ("empty-values-ignored", {"RANK": "", "OMPI_COMM_WORLD_RANK": "  "},
     (0, 1, 0, 1, Launcher.SINGLE)),
]


def _as_tuple(info: LaunchInfo) -> tuple[int, int, int, int, Launcher]:
    return (info.rank, info.world_size, info.local_rank, info.local_world_size, info.launcher)


@pytest.mark.parametrize(("env", "expected"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_each_launcher(env: dict[str, str], expected: tuple[int, int, int, int, Launcher]) -> None:
    assert _as_tuple(detect_launch(env)) == expected


def test_reads_os_environ_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "1")
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "3")
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_RANK", "1")
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_SIZE", "3")
    assert _as_tuple(detect_launch()) == (1, 3, 1, 3, Launcher.OPEN_MPI)


TORCHRUN = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}
OMPI = {"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "4",
        "OMPI_COMM_WORLD_LOCAL_RANK": "0", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}
MPICH = {"PMI_RANK": "3", "PMI_SIZE": "5"}
SLURM = {"SLURM_PROCID": "6", "SLURM_NTASKS": "8", "SLURM_LOCALID": "2",
         "SLURM_NTASKS_PER_NODE": "4"}


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({**TORCHRUN, **OMPI, **SLURM}, Launcher.TORCHRUN),  # torchrun inside an allocation
        ({**OMPI, **SLURM}, Launcher.OPEN_MPI),  # mpirun inside an allocation
        ({**MPICH, **SLURM}, Launcher.MPICH),
        ({**TORCHRUN, **MPICH}, Launcher.TORCHRUN),
        ({**SLURM}, Launcher.SLURM),
    ],
    ids=["torchrun>mpi>slurm", "ompi>slurm", "mpich>slurm", "torchrun>mpich", "slurm"],
)
def test_precedence(env: dict[str, str], expected: Launcher) -> None:
    info = detect_launch(env)
    assert info.launcher is expected
    rank_var = {
        Launcher.TORCHRUN: "RANK", Launcher.OPEN_MPI: "OMPI_COMM_WORLD_RANK",
        Launcher.MPICH: "PMI_RANK", Launcher.SLURM: "SLURM_PROCID",
    }[expected]
    assert info.rank == int(env[rank_var])


def test_explicit_arguments_win() -> None:
    env = {**TORCHRUN, **OMPI, **SLURM}
    info = detect_launch(env, rank=2, world_size=3)
    assert _as_tuple(info) == (2, 3, 2, 3, Launcher.EXPLICIT)
    info = detect_launch(env, rank=3, world_size=4, local_rank=1, local_world_size=2)
    assert _as_tuple(info) == (3, 4, 1, 2, Launcher.EXPLICIT)


def test_explicit_local_values_win_over_launcher() -> None:
    env = {"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}
    assert _as_tuple(detect_launch(env, local_rank=0)) == (1, 4, 0, 2, Launcher.TORCHRUN)
    # The launcher gives no local values: an explicit one is kept, not replaced by the rank.
    assert _as_tuple(detect_launch({"RANK": "1", "WORLD_SIZE": "4"}, local_rank=0)) == (
        1, 4, 0, 4, Launcher.TORCHRUN,
    )
    assert _as_tuple(detect_launch({}, local_rank=0, local_world_size=1)) == (
        0, 1, 0, 1, Launcher.SINGLE,
    )


def test_is_mpi() -> None:
    mpi = {Launcher.OPEN_MPI, Launcher.MPICH, Launcher.PMIX, Launcher.MVAPICH2}
    for launcher in Launcher:
        assert launcher.is_mpi is (launcher in mpi)


@pytest.mark.parametrize(
    ("env", "kwargs", "match"),
    [
        ({"RANK": "one", "WORLD_SIZE": "2"}, {}, "RANK"),
        ({"RANK": "0", "WORLD_SIZE": "2.5"}, {}, "WORLD_SIZE"),
        ({"RANK": "1,0", "WORLD_SIZE": "2"}, {}, "RANK"),  # list syntax is SLURM's alone
        ({"RANK": "2(x3)", "WORLD_SIZE": "4"}, {}, "RANK"),
        ({"RANK": "1"}, {}, "WORLD_SIZE"),  # rank without a size
        ({"RANK": "2", "WORLD_SIZE": "2"}, {}, "rank"),  # out of range
        ({"RANK": "-1", "WORLD_SIZE": "2"}, {}, "rank"),
        ({"RANK": "0", "WORLD_SIZE": "0"}, {}, "world_size"),
        ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "2"}, {},
         "local_rank"),
        ({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "x"}, {}, "OMPI_COMM_WORLD_SIZE"),
        ({"PMI_RANK": "0", "PMI_SIZE": "2", "MPI_LOCALRANKID": "?", "MPI_LOCALNRANKS": "2"}, {},
         "MPI_LOCALRANKID"),
        ({"SLURM_PROCID": "0", "SLURM_NTASKS": "4", "SLURM_LOCALID": "0",
          "SLURM_TASKS_PER_NODE": "(x3)"}, {}, "SLURM_TASKS_PER_NODE"),
        ({"PMIX_RANK": "0"}, {}, "PMIX_SIZE"),
        ({}, {"rank": 0}, "together"),
        ({}, {"world_size": 2}, "together"),
        ({}, {"rank": 2, "world_size": 2}, "rank"),
        ({}, {"rank": 0, "world_size": 2, "local_rank": 1, "local_world_size": 1}, "local_rank"),
        ({"MASTER_ADDR": "h", "MASTER_PORT": "29x"}, {}, "MASTER_PORT"),
        ({"MASTER_ADDR": "h", "MASTER_PORT": "70000"}, {"rank": 0, "world_size": 2},
         "MASTER_PORT"),
    ],
)
def test_malformed_values_raise_value_error(
    env: dict[str, str], kwargs: dict[str, int], match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        detect_launch(env, **kwargs)


def test_cpus_per_local_process(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1, 2, 3}, raising=False)
    assert cpus_per_local_process(2) == 2.0
    assert cpus_per_local_process(8) == 0.5
    monkeypatch.delattr("os.sched_getaffinity", raising=False)
    monkeypatch.setattr("os.cpu_count", lambda: 6)
    assert cpus_per_local_process(3) == 2.0
    with pytest.raises(ValueError, match="local_world_size"):
        cpus_per_local_process(0)


def test_rendezvous_address_comes_from_the_environment_given() -> None:
    env = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": " node7 ", "MASTER_PORT": "29501",
           "TORCHELASTIC_USE_AGENT_STORE": "True"}
    info = detect_launch(env)
    assert (info.master_addr, info.master_port, info.agent_store) == ("node7", 29501, True)
    explicit = detect_launch(env, rank=0, world_size=4)
    assert (explicit.master_addr, explicit.master_port) == ("node7", 29501)
    # Only both together name a store; an MPI launcher then rendezvouses through MPI.
    half = detect_launch({"PMI_RANK": "0", "PMI_SIZE": "2", "MASTER_ADDR": "node7"})
    assert (half.master_addr, half.master_port, half.agent_store) == (None, None, False)


class _AloneInMPI:
    """``MPI.COMM_WORLD`` of a process that MPI sees alone (a torchrun rank with mpi4py)."""

    def Get_rank(self) -> int:
        return 0

    def Get_size(self) -> int:
        return 1

    def allgather(self, value: object) -> list[object]:
        raise AssertionError("no collective with one process")


@pytest.mark.parametrize(("launcher", "hint"), [(Launcher.TORCHRUN, "torchrun started 2 ranks"),
                                                (Launcher.SLURM, "slurm started 2 ranks")])
def test_mpi_under_a_launcher_that_is_not_mpis_says_to_start_the_job_with_mpiexec(
        launcher: Launcher, hint: str) -> None:
    # GRADCOMM_BACKEND=mpi torchrun ... : each rank is an MPI job of one process.
    with pytest.raises(RuntimeError) as info:
        check_launch_matches_mpi(_AloneInMPI(), LaunchInfo(1, 2, 1, 2, launcher))
    text = str(info.value)
    assert hint in text and "mpiexec -n 2" in text and "disagree" not in text, text


@pytest.mark.parametrize(("env", "hint"), [
    ({"RANK": "1", "WORLD_SIZE": "2"}, "torchrun started 2 ranks"),
    ({}, "rank and world_size ask for 2 ranks")])
def test_explicit_ranks_alone_in_mpi_name_who_set_them(monkeypatch: pytest.MonkeyPatch,
                                                       env: dict[str, str], hint: str) -> None:
    # init_process_group("gradcomm") passes torchrun's rank and world size as arguments.
    for name in list(os.environ):
        if name.startswith(("RANK", "WORLD_SIZE", "LOCAL_", "PMI_", "OMPI_", "PMIX_", "SLURM_",
                            "MV2_", "MPI_")):
            monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(RuntimeError) as info:
        check_launch_matches_mpi(_AloneInMPI(), LaunchInfo(1, 2, 1, 2, Launcher.EXPLICIT))
    text = str(info.value)
    assert hint in text and "mpiexec -n 2" in text and "explicit" not in text, text
