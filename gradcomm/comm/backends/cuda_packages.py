"""The pip packages of CUDA-specific dependencies, picked for this torch's CUDA major version.

CuPy and NCCL wheels are built per CUDA major (``cupy-cuda12x``/``cupy-cuda13x``,
``nvidia-nccl-cu12``/``nvidia-nccl-cu13``), and a CuPy of another major than torch's fails at
import or at the first kernel. Every message that names one of them goes through
:func:`cupy_pip` / :func:`nccl_pip`, which read :data:`torch.version.cuda` (``"12.8"``,
``"13.0"``; None on a CPU build).

``[ctk]`` is CuPy's extra that installs the CUDA components CuPy loads (NVRTC, cuBLAS, ...) from
PyPI, which a machine with only a PyPI build of torch (and no system CUDA toolkit) needs.
"""

from __future__ import annotations

import torch

__all__ = ["CUPY_MAJORS", "DEFAULT_CUDA_MAJOR", "cuda_major", "cupy_package", "cupy_pip",
           "nccl_pip"]

#: CUDA majors with CuPy wheels on PyPI (CuPy 14): ``cupy-cuda<major>x``.
CUPY_MAJORS = (12, 13)
#: The major named when torch has no CUDA (a CPU build): torch 2.13's default CUDA wheels.
DEFAULT_CUDA_MAJOR = 12


def cuda_major(version: str | None = None) -> int | None:
    """The CUDA major version of ``version`` (default :data:`torch.version.cuda`), or None.

    Raises:
        ValueError: ``version`` does not start with an integer (e.g. ``"x.1"``).
    """
    text = torch.version.cuda if version is None else version
    if not text:
        return None
    head = str(text).strip().split(".", 1)[0]
    if not head.isdigit():
        raise ValueError(f"not a CUDA version: {text!r} (expected e.g. '12.8')")
    return int(head)


def cupy_package(version: str | None = None) -> str:
    """``cupy-cuda12x`` or ``cupy-cuda13x`` for this torch's CUDA (CPU build: the default major).

    A major outside :data:`CUPY_MAJORS` gets the nearest one CuPy builds for (an older one's
    wheel would not load with a newer driver's toolkit, and vice versa the message is a hint).
    """
    major = cuda_major(version)
    if major is None:
        major = DEFAULT_CUDA_MAJOR
    major = min(max(major, CUPY_MAJORS[0]), CUPY_MAJORS[-1])
    return f"cupy-cuda{major}x"


def cupy_pip(version: str | None = None) -> str:
    """The pip command that installs CuPy for this torch, e.g. ``pip install "cupy-cuda13x[ctk]"``.

    On a CPU build of torch both majors are named: the right one depends on the CUDA build of
    torch that will be installed.
    """
    if cuda_major(version) is None:
        return 'pip install "cupy-cuda12x[ctk]" (or "cupy-cuda13x[ctk]": your torch\'s CUDA major)'
    return f'pip install "{cupy_package(version)}[ctk]"'


def nccl_pip(version: str | None = None) -> str:
    """The pip command for NCCL's library wheel of this CUDA major (``nvidia-nccl-cu13``)."""
    major = cuda_major(version)
    return f"pip install nvidia-nccl-cu{DEFAULT_CUDA_MAJOR if major is None else major}"
