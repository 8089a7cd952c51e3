"""Setting up the MPI backend's compiled calls (gradcomm/comm/backends/mpi/compiled.py): the
on/off switch and its warning, the MPICH ABI constants the C++ uses, the build lock and a failed
build's error line (in-process), and ``GRADCOMM_MPI_COMPILED=1`` raising on every rank when the
calls cannot be built (under ``mpiexec``).
"""

from __future__ import annotations

import logging
import re
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("mpi4py")  # compiled.py imports it: importing starts MPI


def test_the_switch_and_the_warning_when_they_cannot_be_used(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    from gradcomm import SlowPathWarning
    from gradcomm.comm.backends.mpi import compiled

    monkeypatch.setattr(compiled, "_load", lambda: (None, "a reason"))
    compiled._warn_once.cache_clear()
    monkeypatch.delenv(compiled.ENV, raising=False)
    text = (f"compiled MPI calls off (a reason): blocking collectives take the Python path, "
            f"slower by 5-60 % at 1 MiB; set {compiled.ENV}=0 to silence this")
    with caplog.at_level(logging.WARNING, logger="gradcomm.comm.mpi"), pytest.warns(
            SlowPathWarning, match=re.escape(text)) as warned:
        assert compiled.load() is None and compiled.load() is None
    assert [r.getMessage() for r in caplog.records].count(text) == 1 and len(warned) == 1
    # one rank, or device memory: nothing is built, but a bad value still raises
    assert compiled.calls(object(), None, 1, 0, wanted=True) is None
    monkeypatch.setenv(compiled.ENV, "maybe")
    with pytest.raises(ValueError, match=compiled.ENV):
        compiled.calls(object(), None, 1, 0, wanted=False)
    monkeypatch.setenv(compiled.ENV, "1")
    with pytest.raises(RuntimeError, match="a reason"):
        compiled.load()
    monkeypatch.setenv(compiled.ENV, "off")
    assert compiled.load() is None and compiled.unavailable_reason() == f"{compiled.ENV}=0"
    monkeypatch.setenv(compiled.ENV, "maybe")
    with pytest.raises(ValueError, match=compiled.ENV):
        compiled.load()


def test_the_abi_constants_match_mpich_header() -> None:
    header = Path(sys.prefix, "include", "mpi.h")
    if not header.is_file():
        pytest.skip("no MPICH mpi.h in this environment (pip install mpich brings one)")
    text = header.read_text()
    if "MPICH_VERSION" not in text:
        pytest.skip("mpi.h is not MPICH's")
    import gradcomm

    source = Path(gradcomm.__file__).parent.joinpath(
        "comm", "backends", "mpi", "_compiled.h").read_text()
    for handle in ("MPI_Comm", "MPI_Datatype", "MPI_Op", "MPI_Request"):
        assert re.search(rf"typedef int {handle};", text), handle
    assert re.search(r"#define MPI_IN_PLACE\s+\(void \*\) -1", text)
    assert re.search(r"#define MPI_STATUS_IGNORE\s+\(MPI_Status \*\)1", text)
    longest = re.search(r"#define MPI_MAX_ERROR_STRING\s+(\d+)", text)
    ours = re.search(r"kMaxErrorString = (\d+);", source)
    assert longest is not None and ours is not None
    assert int(ours.group(1)) >= int(longest.group(1))
    fields = re.search(r"typedef struct MPI_Status \{(.*?)\} MPI_Status;", text, re.S)
    assert fields is not None
    assert re.findall(r"int\s+(\w+);", fields.group(1)) == [
        "count_lo", "count_hi_and_cancelled", "MPI_SOURCE", "MPI_TAG", "MPI_ERROR"]
    assert "int count_lo, count_hi_and_cancelled, source, tag, error;" in source


def test_a_stale_build_lock_is_removed_and_a_live_one_waited_for(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    import os
    import threading

    from gradcomm.comm.backends.mpi import compiled

    lock = tmp_path / "lock"
    compiled.wait_for_lock(lock)  # none: returns at once
    lock.touch()
    old = time.time() - 2 * compiled.STALE_LOCK_S
    os.utime(lock, (old, old))
    with caplog.at_level(logging.WARNING, logger="gradcomm.comm.mpi"):
        compiled.wait_for_lock(lock)  # left by a killed build
    assert not lock.exists() and "a killed build left it" in caplog.text
    lock.touch()  # another process is building: wait until it removes the lock
    threading.Timer(0.3, lock.unlink).start()
    start = time.monotonic()
    compiled.wait_for_lock(lock, poll_s=0.05)
    assert 0.25 <= time.monotonic() - start < 5 and not lock.exists()


def test_a_failed_build_names_the_error_line() -> None:
    from gradcomm.comm.backends.mpi import compiled

    log = ("[1/5] c++ -c a.cpp\nFAILED: a.o\na.cpp:3:1: error: 'x' was not declared\n"
           "ninja: build stopped")
    assert compiled._first_error(log) == "a.cpp:3:1: error: 'x' was not declared"
    assert compiled._first_error("only this\n") == "only this"
    assert len(compiled._first_error("error " * 100)) == 200


@pytest.mark.slow
@pytest.mark.mpi
def test_gradcomm_mpi_compiled_1_raises_on_every_rank_when_they_cannot_be_built(
        tmp_path: Path) -> None:
    from dist_utils import TESTS_DIR, run_mpi

    blocker = tmp_path / "a-file"
    blocker.write_text("")  # a directory cannot be made below a file
    env = {"GRADCOMM_MPI_COMPILED": "1", "TORCH_EXTENSIONS_DIR": str(blocker / "ext")}
    out = run_mpi(TESTS_DIR / "mpi_scripts" / "compiled_required.py", 2, env=env,
                  timeout=90).stdout
    # each rank's line, also when the two ranks' writes share a line of the joined output
    lines = sorted("RESULT required " + part.splitlines()[0]
                   for part in out.split("RESULT required ")[1:])
    assert len(lines) == 2, out
    for r, line in enumerate(lines):
        assert line.startswith(f"RESULT required raised rank={r} GRADCOMM_MPI_COMPILED=1 but the "
                               "compiled MPI calls cannot be used: the C++ build failed: "), line
