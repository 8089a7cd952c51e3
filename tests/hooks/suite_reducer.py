"""GradientReducer on every backend, as rank-agnostic tests (the module tier,
:mod:`tests._support.rank_suite`; run by ``tests/hooks/test_rank_suites.py``): gradients against
one process's gradients on the global batch (``reducer_grads``), and the reducer's failure
and edge cases (``reducer_cases``): backward passes it must follow, module state and degenerate
models, the model guard, gradient layouts and dtypes.

Each case of ``reducer_cases`` runs on every rank; its verdict needs every rank's result, so the
test gathers them on rank 0, which verifies them and tells every rank its verdict. The runs of
each test are those listed with it: at three ranks some values hold on mpi only (see
:func:`test_gradients_equal_one_process_on_the_global_batch`), the thread backend (a test
double) has no float32 upcast of half precision, and a world size of one makes most cases
vacuous.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import gradcomm

from tests._support import rank_suite
from tests._support import reducer_cases as rc
from tests._support.reducer_grads import reducer_values

#: the runs every case of reducer_cases runs on; the tests below add to them
TWO_AND_THREE = ("threads-2", "threads-3", "gloo-2", "mpi-2")


def on(*run_ids: str) -> Callable[[Any], Any]:
    """Give the decorated test items on the runs ``run_ids`` only."""
    return rank_suite.only(lambda run: run.id in run_ids)


def verified(comm: gradcomm.Communicator, name: str, cases: rc.Cases | None = None) -> None:
    """Run case ``name`` of ``cases`` (default ``reducer_cases.CASES``) on this rank; rank 0
    verifies every rank's result (its references cost a backward each: once is enough, and
    thread ranks would compute them at the same time) and every rank asserts its verdict."""
    mine = rc.run_cases(comm, [name], cases)
    everyone = comm.all_gather_object(mine)
    problems = (rc.verify_case(name, everyone, comm.world_size, cases)  # type: ignore[arg-type]
                if comm.rank == 0 else None)
    problems = comm.broadcast_object(problems)
    assert problems == [], problems


# At 3 ranks the values hold on mpi only: the thread backend (a test double) sums float16 in
# float16, more than the one ulp the case allows from the float32 reference, and gloo's ring adds
# three ranks' values in an order that depends on where an element lies in the buffer, so
# gradients reduced in buckets and in place differ in rounding (the bit-for-bit check). Two
# values add exactly alike in either order.
@on("threads-1", "threads-2", "gloo-2", "mpi-2", "mpi-3")
def test_gradients_equal_one_process_on_the_global_batch(comm: gradcomm.Communicator) -> None:
    assert reducer_values(comm) == (comm.rank, comm.world_size, comm.backend)


# ----------------------------------------------------------------------------- backward passes
@on(*TWO_AND_THREE, "mpi-3", "threads-1")
def test_no_sync_accumulates(comm: gradcomm.Communicator) -> None:
    verified(comm, "no_sync")


@on(*TWO_AND_THREE)
def test_several_backwards_per_step(comm: gradcomm.Communicator) -> None:
    verified(comm, "several_backwards")


@on(*TWO_AND_THREE)
def test_activation_checkpointing(comm: gradcomm.Communicator) -> None:
    verified(comm, "checkpointing")


@on(*TWO_AND_THREE, "mpi-3")
def test_a_backward_that_raised_on_one_rank(comm: gradcomm.Communicator) -> None:
    verified(comm, "raised_on_one_rank")


# ----------------------------------------------------------------------------- module state
@on(*TWO_AND_THREE, "threads-1")
def test_buffers(comm: gradcomm.Communicator) -> None:
    verified(comm, "buffers")


@on(*TWO_AND_THREE, "threads-1")
def test_degenerate_models(comm: gradcomm.Communicator) -> None:
    verified(comm, "degenerate")


# ----------------------------------------------------------------------------- the model guard
@on(*TWO_AND_THREE, "mpi-3")
def test_a_model_that_differs_across_ranks_names_what_differs(comm: gradcomm.Communicator
                                                              ) -> None:
    verified(comm, "fingerprint")


@on(*TWO_AND_THREE)
def test_tied_weights(comm: gradcomm.Communicator) -> None:
    verified(comm, "tied")


@on(*TWO_AND_THREE)
def test_parameters_buffers_or_submodules_replaced_after_wrapping(comm: gradcomm.Communicator
                                                                  ) -> None:
    verified(comm, "replaced")


# ----------------------------------------------------------------------------- layouts, dtypes
@on(*TWO_AND_THREE)
def test_gradient_layouts(comm: gradcomm.Communicator) -> None:
    verified(comm, "layouts")


@on(*TWO_AND_THREE, "mpi-3")
def test_sparse_gradients_and_integer_average(comm: gradcomm.Communicator) -> None:
    verified(comm, "sparse_and_int")


# 3 ranks: the fp32 upcast path of half precision (the thread backend has none)
@on("threads-2", "gloo-2", "mpi-2", "mpi-3", "threads-1")
def test_half_precision(comm: gradcomm.Communicator) -> None:
    verified(comm, "half")
