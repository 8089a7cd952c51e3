"""ShardedOptimizer (ZeRO stages 1 and 2) over real gloo process groups (spawned) and under
mpiexec: parameters equal unsharded training, checkpoints reshard across world sizes, bad input
raises on every rank. One job per world size runs many cases (see mpi_scripts/sharded_checks.py).
"""

from __future__ import annotations

import copy
import re
from pathlib import Path

import pytest
import torch
from mpi_scripts import sharded_checks as sc

import gradcomm

from dist_utils import REPO_ROOT, TESTS_DIR, run_mpi, run_processes

STEPS, MORE = 3, 3


def _values(rank: int, world_size: int) -> list[str]:
    torch.set_num_threads(1)
    with gradcomm.init(backend="gloo") as comm:
        done = sc.value_cases(comm)
        if world_size == 2:
            done += sc.bad_input_cases(comm)
        return done


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(300)
@pytest.mark.parametrize("n", [2, 3, 4])
def test_sharded_equals_unsharded_gloo(n: int) -> None:
    out = run_processes(_values, n, timeout=240)
    assert all(len(o) == len(out[0]) for o in out), out
    assert len(out[0]) == 10 + (3 if n == 2 else 0), out[0]


def _save(rank: int, world_size: int, folder: str) -> None:
    torch.set_num_threads(1)
    with gradcomm.init(backend="gloo") as comm:
        for stage in (1, 2):
            saved: dict[str, object] = {}

            def keep(opt: object, model: torch.nn.Module, step: int,
                     saved: dict[str, object] = saved) -> None:
                if step == STEPS - 1:
                    full = opt.state_dict(to=0)  # type: ignore[attr-defined]
                    saved["full"] = full
                    saved["everywhere"] = opt.state_dict()  # type: ignore[attr-defined]
                    # as torch's, it holds the live state tensors: copy (torch.save would)
                    saved["shard"] = copy.deepcopy(
                        opt.sharded_state_dict())  # type: ignore[attr-defined]
                    saved["model"] = {k: v.clone() for k, v in model.state_dict().items()}
                    assert (full == {}) == (rank != 0)

            model, _ = sc.train(comm, "adamw", stage, STEPS + MORE, after=keep)
            _, ref_opt = sc.train(comm, "adamw", None, STEPS)
            # the gathered state is the unsharded optimizer's, value for value
            want = ref_opt.state_dict()["state"]
            got = saved["everywhere"]["state"]  # type: ignore[index]
            assert sorted(got) == sorted(want)
            for i in want:
                for k, v in want[i].items():
                    sc.check_close(f"state {i} {k}", got[i][k].double(), v.double(), sc.RTOL[stage])
            # sharded save, load at the same world size: continues bit for bit
            cont, _ = sc.train(comm, "adamw", stage, MORE, start=STEPS,
                               shard_state=saved["shard"], model_state=saved["model"])
            sc.check_close("sharded reload", sc.params_of(cont), sc.params_of(model), 0.0)
            if rank == 0:
                torch.save({"full": saved["full"], "model": saved["model"],
                            "final": sc.params_of(model)}, Path(folder) / f"stage{stage}.pt")


def _load(rank: int, world_size: int, folder: str) -> list[float]:
    torch.set_num_threads(1)
    errs = []
    with gradcomm.init(backend="gloo") as comm:
        for stage in (1, 2):
            ckpt = torch.load(Path(folder) / f"stage{stage}.pt", weights_only=False)
            model, _ = sc.train(comm, "adamw", stage, MORE, start=STEPS, state=ckpt["full"],
                                model_state=ckpt["model"])
            got = sc.params_of(model)
            # a different world size sums in another order: rounding only
            errs.append(sc.check_close(f"stage {stage} resumed at {world_size}", got,
                                       ckpt["final"], 1e-5))
            assert sc.identical_across_ranks(comm, got)
    return errs


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(540)  # two jobs, each under run_processes' own 240 s limit
def test_checkpoint_saved_at_two_ranks_resumes_at_three_gloo(tmp_path: Path) -> None:
    run_processes(_save, 2, str(tmp_path), timeout=240)
    errs = run_processes(_load, 3, str(tmp_path), timeout=240)
    assert all(e <= 1e-5 for r in errs for e in r), errs


@pytest.mark.slow
@pytest.mark.mpi
@pytest.mark.timeout(330)
@pytest.mark.parametrize("n", [2, 3, 4])
def test_sharded_equals_unsharded_mpi(n: int) -> None:
    proc = run_mpi(TESTS_DIR / "mpi_scripts" / "sharded_values.py", n, timeout=300,
                   env={"GRADCOMM_BACKEND": "mpi"})
    for rank in range(n):
        assert f"RESULT ok rank={rank} world={n} cases=" in proc.stdout, proc.stdout


@pytest.mark.slow
@pytest.mark.mpi
@pytest.mark.timeout(270)
@pytest.mark.parametrize(("backend", "zero"), [("mpi", "1"), ("gloo", "2")])
def test_digits_example_trains_sharded(backend: str, zero: str) -> None:
    proc = run_mpi(REPO_ROOT / "examples" / "train_digits.py", 2, ["--zero", zero], timeout=240,
                   env={"GRADCOMM_BACKEND": backend})
    final = re.findall(r"final held-out accuracy: ([0-9.]+)", proc.stdout)
    assert len(final) == 1 and float(final[0]) >= 0.95, proc.stdout
    assert "parameters identical on all 2 ranks" in proc.stdout, proc.stdout


# ----------------------------------------------------------------------------- thread ranks (fast)
def _thread_group(n: int) -> object:
    from gradcomm.comm.backends.threads import ThreadGroup

    return ThreadGroup(n, timeout=60)


@pytest.mark.slow  # the full case list: about a minute on 2 busy cores
@pytest.mark.timeout(300)
def test_sharded_equals_unsharded_on_thread_ranks() -> None:
    out = _thread_group(3).run(  # type: ignore[attr-defined]
        lambda comm: sc.value_cases(comm) + sc.bad_input_cases(comm))
    assert all(len(o) == 13 for o in out), out


def test_full_state_reshards_from_three_thread_ranks_to_two() -> None:
    saved: dict[int, object] = {}

    def first(comm: gradcomm.Communicator) -> torch.Tensor:
        def keep(opt: object, model: torch.nn.Module, step: int) -> None:
            if step == STEPS - 1:
                sd = opt.state_dict(to=1)  # type: ignore[attr-defined]
                assert (sd == {}) == (comm.rank != 1)
                if comm.rank == 1:
                    saved[0] = copy.deepcopy((sd, model.state_dict()))

        model, _ = sc.train(comm, "adam", 2, STEPS + MORE, after=keep)
        return sc.params_of(model)

    want = _thread_group(3).run(first)[0]  # type: ignore[attr-defined]
    sd, model_state = saved[0]  # type: ignore[misc]

    def resumed(comm: gradcomm.Communicator) -> torch.Tensor:
        model, _ = sc.train(comm, "adam", 1, MORE, start=STEPS, state=sd, model_state=model_state)
        return sc.params_of(model)

    for got in _thread_group(2).run(resumed):  # type: ignore[attr-defined]
        sc.check_close("resumed at 2 thread ranks", got, want, 1e-5)


def test_sharded_state_refuses_another_world_size() -> None:
    saved: list[object] = []

    def first(comm: gradcomm.Communicator) -> None:
        _, opt = sc.train(comm, "sgd", 1, 1)
        if comm.rank == 0:
            saved.append(opt.sharded_state_dict())

    _thread_group(2).run(first)  # type: ignore[attr-defined]

    def load(comm: gradcomm.Communicator) -> str:
        return sc.expect_error(lambda: sc.train(comm, "sgd", 1, 1, shard_state=saved[0]),
                               ValueError, "world_size")

    assert _thread_group(3).run(load) == ["ValueError:world_size"] * 3  # type: ignore[attr-defined]
