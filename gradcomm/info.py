"""Environment report behind ``gradcomm info``: launcher, ranks, backends, versions, CUDA, MPI.

:func:`collect_info` gathers everything into a JSON-serialisable dict and :func:`format_info`
renders it as text. Nothing here issues a collective or builds a communicator, so the report works
(and cannot hang) on a half-broken installation, with or without a launcher.

MPI is not initialised unless asked (``init_mpi=True``, ``gradcomm info --init-mpi``): when
mpi4py is installed it is imported with ``mpi4py.rc.initialize = False`` (unless the process already
imported it) and only ``MPI.Get_library_version()`` / ``MPI.Get_version()`` are called, which the
MPI standard allows before ``MPI_Init``. The CUDA-aware MPI check can ask the library itself
(``MPIX_Query_cuda_support``) only once MPI is initialised, so without ``--init-mpi`` it may answer
"could not confirm". ``include_mpi=False`` skips mpi4py altogether.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import importlib.util
import os
import platform
import socket
import sys
from collections.abc import Callable, Mapping
from typing import Any

import torch

from . import __version__
from .comm.consistency import debug_level_from_env
from .comm.launch.env import env_flag
from .comm.launch.launcher import detect_launch
from .comm.launch.registry import available_backends
from .comm.launch.selection import resolve_timeout, select_backend

__all__ = ["collect_info", "format_info"]


def _dist_version(module: str) -> str | None:
    """Version of the installed distribution providing top-level ``module`` (no import)."""
    if importlib.util.find_spec(module) is None:
        return None
    for dist in importlib.metadata.packages_distributions().get(module, []):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "unknown"


def _mpi_versions(include_mpi: bool, init_mpi: bool) -> dict[str, Any]:
    out: dict[str, Any] = {
        "mpi4py": _dist_version("mpi4py"), "mpi_library": None, "mpi_standard": None,
    }
    if not include_mpi or out["mpi4py"] is None:
        return out
    try:
        if "mpi4py.MPI" not in sys.modules and not init_mpi:
            import mpi4py

            mpi4py.rc.initialize = False  # a report must not start MPI (or need mpiexec)
            mpi4py.rc.finalize = False
        from mpi4py import MPI

        out["mpi_library"] = MPI.Get_library_version().strip()
        out["mpi_standard"] = "{}.{}".format(*MPI.Get_version())
        out["mpi_initialized"] = bool(MPI.Is_initialized())
    except Exception as exc:  # noqa: BLE001 - a broken MPI install is exactly what to report
        out["mpi_library"] = f"error: {type(exc).__name__}: {exc}"
    return out


def _cuda_info() -> dict[str, Any]:
    available = torch.cuda.is_available()
    info: dict[str, Any] = {
        "available": available,
        "torch_cuda": torch.version.cuda,
        "device_count": torch.cuda.device_count() if available else 0,
        "devices": [],
        "nccl": None,
    }
    if available:
        info["devices"] = [torch.cuda.get_device_name(i) for i in range(info["device_count"])]
        try:
            nccl = torch.cuda.nccl.version()
            info["nccl"] = ".".join(str(v) for v in nccl) if isinstance(nccl, tuple) else str(nccl)
        except Exception as exc:  # noqa: BLE001 - report, do not fail
            info["nccl"] = f"error: {exc}"
    return info


def _cuda_aware_mpi(env: Mapping[str, str], include_mpi: bool) -> dict[str, Any]:
    if not include_mpi:
        return {"available": None, "reason": "not checked (--no-mpi)"}
    try:
        module = importlib.import_module("gradcomm.comm.backends.mpi.device")
    except ImportError as exc:
        return {"available": None, "reason": f"not checked: {exc}"}
    try:
        ok, reason = module.cuda_aware_mpi(env)
    except Exception as exc:  # noqa: BLE001 - report, do not fail
        return {"available": None, "reason": f"check failed: {type(exc).__name__}: {exc}"}
    return {"available": bool(ok), "reason": str(reason)}


def collect_info(
    env: Mapping[str, str] | None = None,
    *,
    backend: str | None = None,
    include_mpi: bool = True,
    init_mpi: bool = False,
) -> dict[str, Any]:
    """Gather the environment report as a JSON-serialisable dict.

    Args:
        env: environment to read (default os.environ).
        backend: the backend argument :func:`gradcomm.init` would get (None: ``GRADCOMM_BACKEND``
            or auto), to report what it would select and why.
        include_mpi: import mpi4py (without initialising MPI) for the MPI library version and
            the CUDA-aware MPI check.
        init_mpi: let importing mpi4py initialise MPI, so the CUDA-aware check can ask the
            library (``MPIX_Query_cuda_support``); under a launcher every rank must do the same.

    Returns:
        A dict with keys ``gradcomm``, ``python``, ``host``, ``launch`` (launcher, rank,
        world_size, local_rank, local_world_size; or ``error``), ``backend`` (selected, reason,
        available, error), ``backends`` (name -> available, reason), ``versions``, ``cuda``,
        ``cuda_aware_mpi``, ``env`` (the ``GRADCOMM_*`` variables) and ``env_errors`` (variable
        -> the error :func:`gradcomm.init` would raise for its value). Problems are reported in
        the dict, never raised.
    """
    env = os.environ if env is None else env
    report: dict[str, Any] = {
        "gradcomm": __version__,
        "python": platform.python_version(),
        "host": socket.gethostname(),
    }
    try:
        launch = detect_launch(env)
        report["launch"] = {
            "launcher": launch.launcher.value, "rank": launch.rank,
            "world_size": launch.world_size, "local_rank": launch.local_rank,
            "local_world_size": launch.local_world_size,
        }
    except ValueError as exc:
        report["launch"] = {"error": str(exc)}

    statuses = available_backends()
    report["backends"] = {
        name: {"available": st.available, "reason": st.reason} for name, st in statuses.items()
    }
    try:
        choice = select_backend(backend, env)
        report["backend"] = {
            "selected": choice.name, "reason": choice.reason,
            "available": statuses[choice.name].available, "error": None,
        }
    except (TypeError, ValueError) as exc:  # e.g. an unknown name: reported, not raised
        requested = backend if backend is not None else env.get("GRADCOMM_BACKEND", "").strip()
        report["backend"] = {"selected": requested or None, "reason": None, "available": False,
                             "error": str(exc)}

    cuda = _cuda_info()
    mpi = _mpi_versions(include_mpi, init_mpi)
    mpi_initialized = mpi.pop("mpi_initialized", False)
    report["versions"] = {
        "gradcomm": __version__, "torch": torch.__version__, "torch_cuda": cuda.pop("torch_cuda"),
        "nccl": cuda.pop("nccl"), **mpi, "cupy": _dist_version("cupy"),
    }
    report["cuda"] = cuda
    aware = _cuda_aware_mpi(env, include_mpi)
    if include_mpi and mpi["mpi4py"] is not None and not mpi_initialized:
        aware["reason"] += "; MPI was not initialised, so the library was not asked (--init-mpi)"
    report["cuda_aware_mpi"] = aware
    report["env"] = {k: v for k, v in sorted(env.items()) if k.startswith("GRADCOMM_")}
    report["env_errors"] = _env_errors(env)
    return report


def _env_errors(env: Mapping[str, str]) -> dict[str, str]:
    """What :func:`gradcomm.init` would raise for each bad ``GRADCOMM_*`` value, by variable."""
    from .profiler import profile_requested, trace_dir_from_env  # lazy, as in gradcomm.init

    errors = {}
    checks: tuple[tuple[str, Callable[[], object]], ...] = (
        ("GRADCOMM_TIMEOUT", lambda: resolve_timeout(None, env)),
        ("GRADCOMM_PROFILE", lambda: profile_requested(env)),
        ("GRADCOMM_PROFILE_DIR", lambda: trace_dir_from_env(env)),
        ("GRADCOMM_DEBUG", lambda: debug_level_from_env(env)),
        *((name, functools.partial(env_flag, name, None, env))
          for name in ("GRADCOMM_MPI_ABORT_ON_ERROR", "GRADCOMM_MPI_CUDA_AWARE")),
    )
    for name, check in checks:
        if env.get(name, "").strip():
            try:
                check()
            except (TypeError, ValueError) as exc:
                errors[name] = str(exc)
    return errors


def _yes_no(flag: bool | None) -> str:
    return "unknown" if flag is None else ("yes" if flag else "no")


def format_info(report: Mapping[str, Any]) -> str:
    """Render :func:`collect_info`'s dict as aligned text (one item per line, no trailing newline).

    Multi-line values (the MPI library banner) are cut to their first line.
    """
    rows: list[tuple[str, str]] = []
    launch = report["launch"]
    if "error" in launch:
        rows.append(("launcher", f"error: {launch['error']}"))
    else:
        rows.append(("launcher", launch["launcher"]))
        rows.append(("rank", f"{launch['rank']} of {launch['world_size']}"))
        rows.append(("local rank", f"{launch['local_rank']} of {launch['local_world_size']}"))
    sel = report["backend"]
    if sel["selected"] is None or sel["error"]:
        rows.append(("backend", f"error: {sel['error']}"))
    else:
        state = "" if sel["available"] else " [NOT AVAILABLE here]"
        rows.append(("backend", f"{sel['selected']} ({sel['reason']}){state}"))
    for name, st in report["backends"].items():
        rows.append((f"  {name}", "available" if st["available"] else f"missing: {st['reason']}"))
    for name, version in report["versions"].items():
        text = "not installed" if version is None else str(version).splitlines()[0].strip()
        if name in ("torch_cuda", "nccl") and version is None:
            text = "n/a (no CUDA)"
        if name in ("mpi_library", "mpi_standard") and version is None:
            text = "n/a" if report["versions"].get("mpi4py") is None else "not queried"
        rows.append((name, text))
    cuda = report["cuda"]
    devices = ", ".join(cuda["devices"]) or "none"
    rows.append(("cuda", f"{_yes_no(cuda['available'])} ({cuda['device_count']} devices: {devices})"
                 if cuda["available"] else "no"))
    aware = report["cuda_aware_mpi"]
    rows.append(("cuda-aware mpi", f"{_yes_no(aware['available'])} ({aware['reason']})"))
    bad = report.get("env_errors", {})
    for key, value in report["env"].items():
        rows.append((key, f"{value}  [INVALID: {bad[key]}]" if key in bad else value))
    width = max(len(k) for k, _ in rows) + 2
    head = f"gradcomm {report['gradcomm']} on {report['host']} (Python {report['python']})"
    return "\n".join([head, *(f"{k:<{width}}{v}" for k, v in rows)])
