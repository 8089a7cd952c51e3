"""Cases of the cross-rank collective check (gradcomm.comm.consistency), for any backend.

``run_cases(comm, names)`` runs the named cases in order on every rank of one communicator and
returns this rank's outcomes (``tests/comm/suite_consistency.py`` runs each on every backend);
``verify(name, outcomes, world_size)`` checks every rank's outcomes of one case (a list of
problems; empty: passed).

Rank 1 is the odd one out in every mismatch case. A mismatch raises before any data moves, on
every rank, at the same call, so the communicator stays in step and the next case can run.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import torch

import gradcomm
from gradcomm import ReduceOp

Outcome = tuple[str, Any]  # ("error", (type name, message)) or ("ok", values)


def _odd(comm: gradcomm.Communicator) -> bool:
    return comm.rank == 1


def _gather_sizes(comm: gradcomm.Communicator) -> object:
    n = 5 if _odd(comm) else 4
    out = torch.zeros(comm.world_size * n)
    comm.all_gather(out, torch.full((n,), float(comm.rank)))
    return out


def _dtype(comm: gradcomm.Communicator) -> object:
    x = torch.ones(3, dtype=torch.float64 if _odd(comm) else torch.float32)
    comm.all_reduce(x)
    return x


def _reduce_op(comm: gradcomm.Communicator) -> object:
    x = torch.tensor([float(comm.rank + 1)])
    comm.all_reduce(x, ReduceOp.MAX if _odd(comm) else ReduceOp.SUM)
    return x


def _root(comm: gradcomm.Communicator) -> object:
    x = torch.tensor([float(comm.rank)])
    comm.broadcast(x, src=1 if _odd(comm) else 0)
    return x


def _op(comm: gradcomm.Communicator) -> object:
    x = torch.tensor([float(comm.rank + 1)])
    if _odd(comm):
        comm.broadcast(x, src=0)
    else:
        comm.all_reduce(x)
    return x


def _skip(comm: gradcomm.Communicator) -> object:
    """Rank 1 skips a broadcast the others make before an all-reduce."""
    x, y = torch.tensor([float(comm.rank)]), torch.tensor([float(comm.rank + 1)])
    if not _odd(comm):
        comm.broadcast(x, src=0)
    comm.all_reduce(y)
    return x, y


def _sequence(comm: gradcomm.Communicator) -> list[torch.Tensor]:
    """Matching calls of every kind; the values are the same with and without the check."""
    r, n = comm.rank, comm.world_size
    a = torch.arange(4.0) + r
    comm.all_reduce(a)
    b = torch.tensor([float(r + 1), -float(r)], dtype=torch.float64)
    comm.all_reduce(b, ReduceOp.MAX)
    c = torch.full((2, 3), float(r))
    comm.all_reduce(c, ReduceOp.AVG, label="bucket 0")
    d = torch.tensor([r * 10], dtype=torch.int64)
    comm.broadcast(d, src=n - 1)
    e = torch.zeros(n * 3, dtype=torch.int32)
    comm.all_gather(e, torch.full((3,), r, dtype=torch.int32))
    comm.barrier()
    work = comm.all_reduce(torch.ones(2) * r, async_op=True)
    work.wait()
    # calls whose sizes differ by rank by design, and transfers between two ranks only
    sizes = [k + 1 for k in range(n)]
    f = torch.zeros(sum(sizes))
    comm.all_gather(f, torch.full((r + 1,), float(r)), output_split_sizes=sizes)
    g = torch.zeros(n * (r + 1))  # rank r receives r + 1 elements from every rank
    comm.all_to_all(g, torch.cat([torch.full((k + 1,), float(r)) for k in range(n)]),
                    output_split_sizes=[r + 1] * n, input_split_sizes=sizes)
    h = torch.zeros(2)
    comm.reduce_scatter(h, torch.arange(2.0 * n) + r)
    i = torch.tensor([float(r)])
    if n > 1 and r < 2:
        (comm.send if r == 0 else comm.recv)(i, 1 - r)
    objs = comm.all_gather_object({"rank": r})
    return [a, b, c, d, e, f, g, h, i, torch.tensor([o["rank"] for o in objs])]


def _expected_sequence(n: int, rank: int) -> list[torch.Tensor]:
    ranks = range(n)
    return [sum(torch.arange(4.0) + r for r in ranks),
            torch.tensor([float(n), 0.0], dtype=torch.float64),
            torch.full((2, 3), sum(ranks) / n),
            torch.tensor([(n - 1) * 10], dtype=torch.int64),
            torch.tensor([r for r in ranks for _ in range(3)], dtype=torch.int32),
            torch.tensor([float(r) for r in ranks for _ in range(r + 1)]),
            torch.cat([torch.full((rank + 1,), float(s)) for s in ranks]),
            n * torch.arange(2.0 * rank, 2.0 * rank + 2) + sum(ranks),
            torch.tensor([0.0 if rank < 2 else float(rank)]),
            torch.tensor(list(ranks))]


def _matching_detail(comm: gradcomm.Communicator) -> object:
    return _sequence(comm)


def _matching_off(comm: gradcomm.Communicator) -> object:
    return _sequence(comm)


#: name: (the case, debug level it runs at, the field named in its error (None: no error))
CASES: dict[str, tuple[Callable[[gradcomm.Communicator], object], str, str | None]] = {
    "gather_sizes": (_gather_sizes, "detail", "element count"),
    "dtype": (_dtype, "detail", "dtype"),
    "reduce_op": (_reduce_op, "detail", "reduce op"),
    "root": (_root, "detail", "root"),
    "op": (_op, "detail", "op"),
    "skip": (_skip, "detail", "op"),
    "matching_detail": (_matching_detail, "detail", None),
    "matching_off": (_matching_off, "off", None),
}

#: The values each field's error names, rank 1 second: (rank 1's, everyone else's), and the op
#: rank 0 was at.
_VALUES = {"element count": ("5", "4", "all_gather"), "dtype": ("float64", "float32", "all_reduce"),
           "reduce op": ("MAX", "SUM", "all_reduce"), "root": ("1", "0", "broadcast"),
           "op": ("broadcast", "all_reduce", "all_reduce")}


def _plain(value: object) -> object:
    """Tensors as (dtype name, nested lists): outcomes travel between processes by pickle."""
    if isinstance(value, torch.Tensor):
        return str(value.dtype), value.tolist()
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def run_cases(comm: gradcomm.Communicator, names: list[str]) -> list[Outcome]:
    """Run ``names`` in order on this rank; each outcome is what the caller saw (tensors as
    ``(dtype name, values)``)."""
    outcomes: list[Outcome] = []
    for name in names:
        fn, level, _ = CASES[name]
        comm.debug = level
        try:
            outcomes.append(("ok", _plain(fn(comm))))
        except Exception as exc:  # noqa: BLE001 - the case records what the user sees
            outcomes.append(("error", (type(exc).__name__, str(exc))))
        comm.debug = "off"
    return outcomes


def expected_message(name: str, world_size: int, seq: int) -> str:
    """The exact error of mismatch case ``name`` at ``world_size`` ranks, rank 0 at call ``seq``."""
    field = CASES[name][2]
    assert field is not None
    odd, rest, where = _VALUES[field]
    if name == "skip":
        where, odd, rest = "broadcast", "all_reduce", "broadcast"
    others = "rank 0" if world_size == 2 else "ranks 0," + ",".join(map(str, range(2, world_size)))
    return (f"ranks called different collectives at rank 0's {where} #{seq}, first difference "
            f"in {field} ({others}: {rest}; rank 1: {odd})")


def verify(name: str, outcomes: list[Outcome], world_size: int) -> list[str]:
    """Problems with every rank's ``outcomes`` of case ``name`` (in rank order)."""
    field = CASES[name][2]
    if field is None:
        wants = [_plain(_expected_sequence(world_size, rank)) for rank in range(world_size)]
        return [f"rank {rank}: {status} {values} != {wants[rank]}"
                for rank, (status, values) in enumerate(outcomes)
                if status != "ok" or values != wants[rank]]
    problems = []
    seqs = set()
    for rank, (status, value) in enumerate(outcomes):
        if status != "error" or value[0] != "RuntimeError":
            problems.append(f"rank {rank}: expected RuntimeError, got {status} {value}")
            continue
        found = re.search(r" #(\d+),", value[1])
        seq = int(found.group(1)) if found else -1
        seqs.add(seq)
        want_text = expected_message(name, world_size, seq)
        if value[1] != want_text:
            problems.append(f"rank {rank}: {value[1]!r} != {want_text!r}")
    if len(seqs) > 1:
        problems.append(f"ranks name different calls: {sorted(seqs)}")
    return problems
