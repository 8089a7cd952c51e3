"""Which gradcomm transport carries each device type's tensors in a "gradcomm" process group.

The rule, first match wins: the ``transport`` of the :class:`Options` given to
``init_process_group(pg_options=...)`` > ``GRADCOMM_BACKEND`` > auto (as :func:`gradcomm.init`
chooses: nccl for CUDA where it is usable, else gloo). Either names one transport (``"mpi"``) or
one per device type in torch's syntax (``"cpu:mpi,cuda:nccl"``). A device type the named transport
does not take gets the auto choice: ``GRADCOMM_BACKEND=mpi`` is mpi for CPU and CUDA tensors,
``GRADCOMM_BACKEND=nccl`` is nccl for CUDA tensors and gloo for CPU ones.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from gradcomm.comm import available_backends

__all__ = ["Options", "transport_for"]

#: Device types each built-in transport takes (others: only the device type they are named for).
_TAKES: dict[str, frozenset[str]] = {
    "gloo": frozenset({"cpu"}),
    "mpi": frozenset({"cpu", "cuda"}),
    "nccl": frozenset({"cuda"}),
    "cupy-nccl": frozenset({"cuda"}),
}


@dataclass(frozen=True)
class Options:
    """Options of a "gradcomm" process group: ``init_process_group("gradcomm", pg_options=...)``.

    Attributes:
        transport: a gradcomm backend name (``"gloo"``, ``"mpi"``, ``"nccl"``, ``"cupy-nccl"``
            or a registered one), or one per device type as ``"cpu:mpi,cuda:nccl"`` or
            ``{"cpu": "mpi", "cuda": "nccl"}``; None: ``GRADCOMM_BACKEND``, else auto.

    Groups made by ``new_group`` use the default group's transports; their options may only
    repeat them.
    """

    transport: str | Mapping[str, str] | None = None

    def __post_init__(self) -> None:
        value = self.transport
        if value is not None and not isinstance(value, (str, Mapping)):
            raise TypeError(f"Options.transport must be a str, a mapping or None, got "
                            f"{type(value).__name__}")
        if isinstance(value, Mapping):
            object.__setattr__(self, "transport", dict(value))
        _per_device(value, "Options.transport")  # a bad name raises here, not at first use


def _per_device(value: str | Mapping[str, str] | None, source: str) -> dict[str, str]:
    """``{device type or "": transport}`` of ``value`` ("" is "every device type it takes").

    Raises:
        ValueError: an empty or unknown transport name, or a malformed ``device:name`` list.
        TypeError: a mapping whose keys or values are not strings.
    """
    if value is None:
        return {}
    if isinstance(value, str):
        items: list[tuple[str, str]] = []
        for part in value.split(","):
            device, sep, name = part.strip().rpartition(":")
            if sep and not device.strip():
                raise ValueError(f"{source}: {part.strip()!r} names no device type")
            items.append((device.strip(), name))
    else:
        items = list(value.items())
    known = set(available_backends())
    out: dict[str, str] = {}
    for device, name in items:
        if not isinstance(device, str) or not isinstance(name, str):
            raise TypeError(f"{source}: device types and transports must be strings")
        key = name.strip().lower().replace("_", "-")
        if key not in known:
            raise ValueError(f"{source}: unknown transport {name!r}; known: "
                             f"{', '.join(sorted(known))}")
        out[device.strip().lower()] = key
    return out


def _auto(device_type: str) -> str:
    if device_type == "cuda":
        status = available_backends().get("nccl")
        return "nccl" if status is not None and status.available else "mpi"
    return "gloo"


def transport_for(device_type: str, options: Options | None,
                  env: Mapping[str, str] | None = None) -> str:
    """The transport of ``device_type``'s tensors (see the module docstring).

    Raises:
        ValueError: ``GRADCOMM_BACKEND`` names no transport or is malformed.
    """
    env = os.environ if env is None else env
    if options is not None and options.transport is not None:
        chosen = _per_device(options.transport, "Options.transport")
    else:
        chosen = _per_device(env.get("GRADCOMM_BACKEND", "").strip() or None, "GRADCOMM_BACKEND")
    if device_type in chosen:
        return chosen[device_type]
    name = chosen.get("")
    if name is not None and device_type in _TAKES.get(name, frozenset({device_type})):
        return name
    return _auto(device_type)
