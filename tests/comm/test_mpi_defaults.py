"""gradcomm's defaults for MPICH variables: set only when unset, and only before MPI starts."""

from __future__ import annotations

import sys
import types

import pytest

from gradcomm.comm._mpi_defaults import MPICH_DEFAULTS, apply_mpich_defaults

NAME = "MPIR_CVAR_IREDUCE_SCATTER_BLOCK_INTRA_ALGORITHM"


@pytest.fixture
def mpi_not_started(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(sys.modules, "mpi4py.MPI", raising=False)


def test_unset_variables_get_the_defaults(mpi_not_started: None) -> None:
    env = {"PATH": "/bin"}
    assert apply_mpich_defaults(env) == MPICH_DEFAULTS
    assert env[NAME] == "sched_pairwise"
    assert env["PATH"] == "/bin"


@pytest.mark.parametrize("value", ["auto", "", "tsp_recexch"])
def test_a_value_the_user_set_is_kept(mpi_not_started: None, value: str) -> None:
    env = {NAME: value}
    assert NAME not in apply_mpich_defaults(env)
    assert env[NAME] == value


def test_nothing_is_set_once_mpi_started(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "mpi4py.MPI", types.ModuleType("mpi4py.MPI"))
    env: dict[str, str] = {}
    assert apply_mpich_defaults(env) == {}
    assert env == {}


def test_the_process_record_names_what_gradcomm_set(mpi_not_started: None,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    from gradcomm.bench.sweep import mpich_settings
    from gradcomm.comm import _mpi_defaults

    monkeypatch.setattr(_mpi_defaults, "_applied", {})
    monkeypatch.setenv(NAME, "")  # records the variable's state, restored after the test
    monkeypatch.delenv(NAME)
    apply_mpich_defaults()
    assert _mpi_defaults.applied_defaults() == MPICH_DEFAULTS
    assert mpich_settings()[NAME] == "sched_pairwise (gradcomm's default)"
    monkeypatch.setenv(NAME, "auto")
    assert mpich_settings()[NAME] == "auto"
