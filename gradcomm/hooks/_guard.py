"""The model guard: which parameters a reducer owns, and the checks that they stay the ones it owns.

At construction, :func:`named_params` and :func:`trainable_params` pick the parameters (tied ones
once, frozen ones skipped) and refuse what cannot be reduced. Before each forward and backward,
:class:`ModelGuard` checks that the wrapped module still holds those parameters, in the layout
their buckets were sized for, and that no trainable parameter was added or unfrozen: a gradient
the reducer does not know would stay local and the ranks would drift apart.
"""

from __future__ import annotations

import operator
import weakref
from collections.abc import Iterable, Sequence
from typing import Any, NoReturn

import torch
from torch import nn

from ..comm.communicator import Communicator
from ..comm.errors import brief
from ._structure import ModuleBuffers, StructureWatch

# Closing advice of the errors for a model changed after wrapping (details: docs/failures.md).
_REBUILD = "change the model before wrapping it (reducer.remove() first)"

__all__ = ["ModelGuard", "named_params", "trainable_params", "claim_params",
           "release_params"]

# Which live reducer reduces a parameter: id(param) -> (param, its reducer's guard), both weakly.
_OWNERS: dict[int, tuple[weakref.ref[torch.Tensor], weakref.ref[ModelGuard]]] = {}

# What the forward check compares: (what, table, key, the object expected at table[key]).
_Entry = tuple[str, dict[str, Any], str, object]


def _first_changed(entries: list[_Entry]) -> str | None:
    """The ``what`` of the first entry whose table no longer holds its object, else None."""
    for what, table, local, obj in entries:
        if table.get(local) is not obj:
            return what
    return None


class _Unchanged:
    """Whether every table of some entries still holds its object: one identity comparison per
    entry, in C (``map``), as each forward runs it."""

    __slots__ = ("_keys", "_objs", "_tables")

    def __init__(self, entries: list[_Entry]) -> None:
        self._tables = [table for _, table, _, _ in entries]
        self._keys = [local for _, _, local, _ in entries]
        self._objs = [obj for _, _, _, obj in entries]

    def __call__(self) -> bool:
        return all(map(operator.is_, map(dict.get, self._tables, self._keys), self._objs))


# What the forward check reads of each reduced parameter, compared with what it was.
_param_state = operator.attrgetter("requires_grad", "dtype", "shape")
_requires_grad = operator.attrgetter("requires_grad")


def named_params(
    module_or_params: nn.Module | Iterable[Any],
) -> tuple[nn.Module | None, list[tuple[str, torch.Tensor]]]:
    """``(module or None, [(name, tensor)])`` of what the reducer was given, deduplicated.

    Raises:
        TypeError: a single tensor, a parameter group (dict), a non-str name or a non-tensor.
    """
    if isinstance(module_or_params, nn.Module):
        return module_or_params, list(module_or_params.named_parameters())
    if isinstance(module_or_params, torch.Tensor):
        raise TypeError("pass an nn.Module or an iterable of parameters, not a single tensor")
    if not isinstance(module_or_params, Iterable):
        raise TypeError("GradientReducer takes an nn.Module or an iterable of parameters, got "
                        f"{type(module_or_params).__name__}")
    out: list[tuple[str, torch.Tensor]] = []
    seen: set[int] = set()
    for i, item in enumerate(module_or_params):
        if isinstance(item, dict):
            raise TypeError("parameter groups (dicts) are not supported; pass the parameters")
        name, p = item if isinstance(item, tuple) else (f"params.{i}", item)
        if not isinstance(name, str):
            raise TypeError(f"parameter names must be str (as in named_parameters()), got "
                            f"{type(name).__name__} {name!r} for item {i}")
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"{name} is a {type(p).__name__}, not a torch.Tensor")
        if id(p) not in seen:
            seen.add(id(p))
            out.append((name, p))
    return None, out


def _sparse_param_names(module: nn.Module | None) -> set[str]:
    if module is None:
        return set()
    out = set()
    for mname, m in module.named_modules():
        if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse:
            out.add(f"{mname}.weight" if mname else "weight")
    return out


def trainable_params(
    module: nn.Module | None, named: list[tuple[str, torch.Tensor]], comm: Communicator
) -> list[tuple[int, str, nn.Parameter]]:
    """``(index, name, parameter)`` of each parameter that requires a gradient, in order.

    Raises:
        TypeError: a parameter that is not a leaf, not strided, or produces sparse gradients.
        ValueError: a parameter on a device type ``comm`` does not serve.
    """
    sparse_names = _sparse_param_names(module)
    trainable: list[tuple[int, str, nn.Parameter]] = []
    for name, p in named:
        if not p.requires_grad:
            continue
        if not p.is_leaf:
            raise TypeError(f"parameter {name} is not a leaf tensor; gradients of non-leaf "
                            "tensors are not accumulated")
        if p.layout is not torch.strided:
            raise TypeError(f"parameter {name} is not a dense (strided) tensor")
        if name in sparse_names:
            raise TypeError(f"parameter {name} produces sparse gradients (sparse=True), which "
                            "gradcomm does not reduce; construct the module with sparse=False")
        if p.device.type != comm.device.type:
            raise ValueError(f"parameter {name} is on {p.device}, but the {comm.backend} "
                             f"communicator reduces tensors on {comm.device}")
        trainable.append((len(trainable), name, p))  # type: ignore[arg-type]
    return trainable


def claim_params(guard: ModelGuard) -> None:
    """Record ``guard``'s reducer as the one reducing its parameters.

    Raises:
        RuntimeError: a parameter is reduced by another live reducer (not removed): every
            backward would send its gradient twice. Raised before any collective, so on every
            rank that builds the same reducers.
    """
    for name, p in zip(guard.names, guard.params, strict=True):
        entry = _OWNERS.get(id(p))
        if entry is None or entry[0]() is not p:
            continue
        other = entry[1]()
        if other is not None and other is not guard and other.owning:
            raise RuntimeError(
                f"parameter {brief(name, 50)} is already reduced by another GradientReducer; "
                "call remove() on that one first, or build one reducer for the whole model"
            )
    for p in guard.params:
        _OWNERS[id(p)] = (weakref.ref(p), weakref.ref(guard))


def release_params(guard: ModelGuard) -> None:
    """Forget ``guard``'s claim (its reducer was removed)."""
    guard.owning = False
    for p in guard.params:
        entry = _OWNERS.get(id(p))
        if entry is not None and entry[1]() in (guard, None):
            del _OWNERS[id(p)]


def _raise_unreduced(name: str) -> NoReturn:
    raise RuntimeError(
        f"parameter {brief(name, 60)} was added, replaced or unfrozen after the "
        f"GradientReducer was built; {_REBUILD}"
    )


class ModelGuard:
    """Checks that the reduced parameters are still the module's, as they were at construction.

    ``watch`` (None without a module) notices registrations on any module, so the module is walked
    only after one (see :mod:`._structure`).
    """

    def __init__(self, module: nn.Module | None, params: list[nn.Parameter], names: list[str],
                 named: Sequence[tuple[str, torch.Tensor]]) -> None:
        self.module = module
        self.params = params
        self.names = names
        self._owners: list[_Entry] = []
        self._links: list[_Entry] = []
        self._frozen: list[tuple[str, torch.Tensor]] = []  # may be unfrozen later
        self._frozen_tensors: list[torch.Tensor] = []
        self._param_ids = frozenset(id(p) for p in params)
        self.owning = True  # its reducer reduces the parameters (see claim_params)
        self._layouts = [(p.dtype, p.shape) for p in params]  # what the buckets hold
        self._states = [(True, dtype, shape) for dtype, shape in self._layouts]
        self._owners_unchanged = self._links_unchanged = _Unchanged([])
        self.watch: StructureWatch | None = None
        self._buffers: ModuleBuffers | None = None
        if module is not None:
            self._watch_entries(named)
            self.watch = StructureWatch()
            self._buffers = ModuleBuffers(module, self.watch)

    def buffers(self) -> list[torch.Tensor]:
        """The module's buffers now, in ``named_buffers()`` order (none without a module)."""
        return [] if self._buffers is None else self._buffers.current()

    def _ownership(self) -> tuple[list[_Entry], list[_Entry]]:
        """What the forward check compares by identity: each reduced parameter in its module's
        ``_parameters`` table, and each submodule on a path from the root to such a module in
        its parent's ``_modules`` table -- every path, for a submodule registered in two places
        -- so that a submodule replaced by one without parameters, moved or deleted is noticed
        too (the replaced module's own table still holds its parameters)."""
        assert self.module is not None  # only called with a module
        owners: list[_Entry] = []
        links: list[_Entry] = []
        watched = {id(p) for p in self.params}
        paths = list(self.module.named_modules(remove_duplicate=False))
        by_path = dict(paths)
        seen: set[int] = set()
        on_path: set[str] = set()
        for mname, m in paths:
            params = [(local, p) for local, p in m._parameters.items()
                      if p is not None and id(p) in watched]
            if not params:
                continue
            if id(m) not in seen:
                seen.add(id(m))
                prefix = f"{mname}." if mname else ""
                owners += [(f"parameter {prefix}{local}", m._parameters, local, p)
                           for local, p in params]
            parts = mname.split(".") if mname else []
            on_path.update(".".join(parts[:k]) for k in range(1, len(parts) + 1))
        for path in sorted(on_path):
            parent, _, local = path.rpartition(".")
            links.append((f"submodule {path}", by_path[parent]._modules, local, by_path[path]))
        # Buffers are not watched: they have no gradient, and broadcast_buffers reads them
        # afresh each forward, so a buffer reassigned (``self.avg = 0.9 * self.avg + ...``)
        # is simply picked up.
        return owners, links

    def _watch_entries(self, named: Sequence[tuple[str, torch.Tensor]]) -> None:
        """Record what the forward check compares against: every reduced parameter in its
        module's table, the submodules on the way to them, and the frozen parameters (``named``:
        the module's)."""
        self._owners, self._links = self._ownership()
        self._owners_unchanged = _Unchanged(self._owners)
        self._links_unchanged = _Unchanged(self._links)
        self._frozen = [(n, t) for n, t in named if not t.requires_grad]
        self._frozen_tensors = [t for _, t in self._frozen]

    def check(self) -> None:
        """Raise RuntimeError naming the first parameter or submodule changed since wrapping.

        Runs before every forward: what stayed as it was is compared in C (``map``) without a
        Python step per parameter, and without keeping an object per parameter alive (which would
        set off the garbage collector); only a difference is looked for one by one, to name it.
        """
        # One pass: each state tuple is compared and freed at once.
        if not (all(map(operator.eq, map(_param_state, self.params), self._states))
                and self._owners_unchanged()):
            self._check_params()
        if self.module is None or self.watch is None:
            return
        # A parameter unfrozen, or a submodule or parameter added or replaced, after wrapping: its
        # gradient would stay local. Unfreezing keeps the registered object, so it is checked
        # here; anything registered shows in the watch, and only then is the module walked.
        if (any(map(_requires_grad, self._frozen_tensors)) or self.watch.changed
                or not self._links_unchanged()):
            self._check_structure()

    def _check_params(self) -> None:
        """:meth:`check`'s parameter checks, one by one, raising on the first difference."""
        for name, p, (dtype, shape) in zip(self.names, self.params, self._layouts, strict=True):
            if not p.requires_grad:  # frozen after wrapping, maybe on some ranks only
                raise RuntimeError(
                    f"parameter {brief(name, 60)} was frozen (requires_grad=False) after the "
                    f"GradientReducer was built; {_REBUILD}"
                )
            if p.dtype != dtype or p.shape != shape:  # model.double(), p.data = other shape
                raise RuntimeError(
                    f"parameter {brief(name, 50)} is now {p.dtype} {tuple(p.shape)}, but it was "
                    f"{dtype} {tuple(shape)} when the GradientReducer was built; {_REBUILD}"
                )
        what = _first_changed(self._owners)
        if what is not None:
            raise RuntimeError(
                f"{brief(what, 70)} was replaced after the GradientReducer was built; {_REBUILD}"
            )

    def _check_structure(self) -> None:
        """:meth:`check`'s module checks, one by one, raising on the first difference."""
        assert self.module is not None and self.watch is not None  # checked by the caller
        for name, frozen in self._frozen:
            if frozen.requires_grad:
                _raise_unreduced(name)
        changed = self.watch.changed
        named: list[tuple[str, torch.Tensor]] = []
        if changed:
            known = self._param_ids
            named = list(self.module.named_parameters())
            for name, t in named:
                if t.requires_grad and id(t) not in known:
                    _raise_unreduced(name)
        # A submodule on the way to reduced parameters replaced without new trainable ones (by
        # nn.Identity(), a frozen copy) or deleted (``del``, which no registration hook sees).
        what = _first_changed(self._links)
        if what is not None:
            raise RuntimeError(
                f"{brief(what, 60)} was replaced, moved or deleted after the GradientReducer was "
                f"built; {_REBUILD}"
            )
        if changed:
            self._watch_entries(named)  # only frozen parameters came: watch them too
            self.watch.changed = False
