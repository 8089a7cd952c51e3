"""The one on/off parser behind GRADCOMM_PROFILE, GRADCOMM_MPI_CUDA_AWARE and
GRADCOMM_MPI_ABORT_ON_ERROR: the same words mean the same thing for each of them."""

from __future__ import annotations

import pytest

from gradcomm.comm.backends.mpi.abort import abort_on_error_enabled
from gradcomm.comm.backends.mpi.device import cuda_aware_mpi
from gradcomm.comm.launch.env import OFF_WORDS, ON_WORDS, env_flag
from gradcomm.profiler import profile_requested

NAME = "GRADCOMM_TEST_SWITCH"


@pytest.mark.parametrize("word", [*ON_WORDS, "TRUE", " Yes ", "ON\n"])
def test_on_words(word: str) -> None:
    for default in (False, True, None):
        assert env_flag(NAME, default, {NAME: word}) is True


@pytest.mark.parametrize("word", [*OFF_WORDS, "FALSE", " No ", "Off\t"])
def test_off_words(word: str) -> None:
    for default in (False, True, None):
        assert env_flag(NAME, default, {NAME: word}) is False


@pytest.mark.parametrize("env", [{}, {NAME: ""}, {NAME: "   "}])
def test_unset_or_blank_gives_the_default(env: dict[str, str]) -> None:
    assert env_flag(NAME, True, env) is True
    assert env_flag(NAME, False, env) is False
    assert env_flag(NAME, None, env) is None


@pytest.mark.parametrize("raw", ["maybe", "2", "-1", "y", "n", "enabled", "1.0", "tru"])
def test_other_values_raise_naming_variable_and_value(raw: str) -> None:
    with pytest.raises(ValueError) as info:
        env_flag(NAME, False, {NAME: raw})
    message = str(info.value)
    assert NAME in message and repr(raw) in message and "1/true/yes/on" in message


def test_reads_os_environ_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(NAME, "on")
    assert env_flag(NAME, False) is True
    monkeypatch.delenv(NAME)
    assert env_flag(NAME, False) is False


@pytest.mark.parametrize(("word", "on"), [(" YES ", True), ("Off", False)])
def test_the_three_switches_agree(word: str, on: bool) -> None:
    assert profile_requested({"GRADCOMM_PROFILE": word}) is on
    assert abort_on_error_enabled({"GRADCOMM_MPI_ABORT_ON_ERROR": word}) is on
    aware, reason = cuda_aware_mpi({"GRADCOMM_MPI_CUDA_AWARE": word})
    assert aware is on and word.strip() in reason


def test_the_three_switches_default_differently_when_blank() -> None:
    assert profile_requested({"GRADCOMM_PROFILE": " "}) is False
    assert abort_on_error_enabled({"GRADCOMM_MPI_ABORT_ON_ERROR": ""}) is True
    # blank GRADCOMM_MPI_CUDA_AWARE: not forced, so detection runs (and says why, without the var)
    aware, reason = cuda_aware_mpi({"GRADCOMM_MPI_CUDA_AWARE": "", "MPIR_CVAR_ENABLE_GPU": "0"})
    assert aware is False and "MPIR_CVAR_ENABLE_GPU" in reason


@pytest.mark.parametrize("read", [
    lambda raw: profile_requested({"GRADCOMM_PROFILE": raw}),
    lambda raw: abort_on_error_enabled({"GRADCOMM_MPI_ABORT_ON_ERROR": raw}),
    lambda raw: cuda_aware_mpi({"GRADCOMM_MPI_CUDA_AWARE": raw}),
])
def test_the_three_switches_refuse_a_typo(read: object) -> None:
    with pytest.raises(ValueError, match="must be one of 1/true/yes/on"):
        read("ture")  # type: ignore[operator]
