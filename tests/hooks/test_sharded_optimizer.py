"""ShardedOptimizer (ZeRO stages 1 and 2): checkpoints reshard across world sizes (spawned gloo
groups and thread ranks), the example trains sharded under mpiexec, and state and options on
thread ranks. Parameters equal to unsharded training, gradient state and bad input on gloo and
mpi are the module tier's (``tests/hooks/suite_sharded.py``, cases in
``tests/_support/sharded_checks.py``).
"""

from __future__ import annotations

import copy
import re
from pathlib import Path

import pytest
import torch

import gradcomm

from tests._support import ranks
from tests._support import sharded_checks as sc
from tests._support.dist_utils import REPO_ROOT, run_mpi
from tests._support.ranks import RankRunner

STEPS, MORE = 3, 3


def _save(comm: gradcomm.Communicator, folder: str) -> None:
    rank = comm.rank
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


def _load(comm: gradcomm.Communicator, folder: str) -> list[float]:
    errs = []
    for stage in (1, 2):
        ckpt = torch.load(Path(folder) / f"stage{stage}.pt", weights_only=False)
        model, _ = sc.train(comm, "adamw", stage, MORE, start=STEPS, state=ckpt["full"],
                            model_state=ckpt["model"])
        got = sc.params_of(model)
        # a different world size sums in another order: rounding only
        errs.append(sc.check_close(f"stage {stage} resumed at {comm.world_size}", got,
                                   ckpt["final"], 1e-5))
        assert sc.identical_across_ranks(comm, got)
    return errs


@pytest.mark.timeout(540)  # two jobs, each under the runner's own 240 s limit
@pytest.mark.parametrize("comm_runner", [ranks.GLOO], indirect=True)
def test_checkpoint_saved_at_two_ranks_resumes_at_three_gloo(comm_runner: RankRunner,
                                                             tmp_path: Path) -> None:
    comm_runner(_save, 2, str(tmp_path), timeout=240)
    errs = comm_runner(_load, 3, str(tmp_path), timeout=240)
    assert all(e <= 1e-5 for r in errs for e in r), errs


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


def test_full_state_reshards_from_three_thread_ranks_to_two() -> None:
    saved: dict[int, object] = {}

    def first(comm: gradcomm.Communicator) -> torch.Tensor:
        def keep(opt: object, model: torch.nn.Module, step: int) -> None:
            if step == STEPS - 1:
                sd = opt.state_dict(to=1)  # type: ignore[attr-defined]
                assert (sd == {}) == (comm.rank != 1)
                # in parameter order, as torch.optim's
                assert list(sd.get("state", {})) == sorted(sd.get("state", {})), sd["state"].keys()
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


def test_stage2_remove_leaves_plain_local_gradients() -> None:
    # After reducer.remove(), the stand-ins are gone and no hook of the optimizer is left: a
    # backward stores this rank's own gradient, as without any reducer.
    def body(comm: gradcomm.Communicator) -> list[bool]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
        reducer = gradcomm.GradientReducer(model, comm)
        opt = gradcomm.ShardedOptimizer(reducer, torch.optim.SGD, stage=2, lr=0.1)
        x = torch.randn(5, 4, generator=torch.Generator().manual_seed(comm.rank))
        model(x).square().sum().backward()
        opt.step()
        model(x).square().sum().backward()  # leaves stand-ins in param.grad
        reducer.remove()
        assert all(p.grad is None for p in model.parameters())
        local = copy.deepcopy(model)
        for m in (model, local):
            m(x).square().sum().backward()
        return [torch.equal(p.grad, q.grad) and p.grad.abs().sum() > 0  # type: ignore[union-attr]
                for p, q in zip(model.parameters(), local.parameters(), strict=True)]

    for got in _thread_group(2).run(body):  # type: ignore[attr-defined]
        assert got == [True] * 4, got
