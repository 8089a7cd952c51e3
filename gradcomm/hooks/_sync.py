"""Construction-time agreement between ranks: a model fingerprint check and a state broadcast.

Both are written against the :class:`~gradcomm.comm.Communicator` interface only, so they work on
every backend. The fingerprint check is one all-gather of two int64 numbers per rank (entry count
and a 64-bit BLAKE2b digest) on the good path; only on a mismatch do two more all-gathers find and
name the first differing entry. The broadcast packs tensors of any dtype into one uint8 buffer per
device (no pickling; int64 and bool buffers keep their dtype), like DDP's coalesced module-state
sync.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence

import torch

from ..comm.communicator import Communicator
from ..comm.errors import MESSAGE_LIMIT, brief

__all__ = ["check_fingerprint", "broadcast_tensors"]

_DESC_BYTES = 256  # bytes of the description exchanged for the first differing entry
_ALIGN = 16  # byte alignment of each tensor inside a packed broadcast buffer
_CHUNK_BYTES = 64 * 2**20  # packed broadcast buffers are at most this large (or one tensor)
_NO_ENTRY = "<no such entry>"


def _digest(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little",
                          signed=True)


def _gather(comm: Communicator, mine: torch.Tensor) -> torch.Tensor:
    """All-gather the 1-D CPU tensor ``mine``; the result is a CPU tensor ``world_size`` times as
    long. The collective runs on ``comm.device`` (a CUDA communicator refuses host tensors), so
    the data is copied there and back: a few bytes, once per construction."""
    out = torch.empty(comm.world_size * mine.numel(), dtype=mine.dtype, device=comm.device)
    comm.all_gather(out, mine.to(comm.device))
    return out.cpu()


def check_fingerprint(
    comm: Communicator,
    entries: Sequence[str],
    *,
    problem: str = "the model differs across ranks",
    fix: str = "build the same model, with the same options, on every rank",
    entry: str | None = None,
    limit: int = MESSAGE_LIMIT,
) -> None:
    """Check that every rank holds the same ``entries`` (e.g. ``"name shape dtype"`` per tensor).

    Args:
        comm: the communicator; at world_size 1 nothing is exchanged.
        entries: one description per parameter/buffer, in registration order.
        problem: the error message's opening words.
        fix: the closing advice, kept when the message has room for it.
        entry: what an entry describes, named after its index (default: the words the
            differing entries start with, e.g. ``param 1.weight``).
        limit: the message's length at most, in characters.

    Raises:
        ValueError: on every rank, when the entries differ; the message names the first entry
            that differs (by its own words, e.g. ``param 0.weight``) and what rank 0 and the first
            rank that differs have there (only the
            words that differ, or ``'<no such entry>'`` where a rank has fewer entries).
    """
    if comm.world_size == 1:
        return
    ws = comm.world_size
    hashes = [_digest(e) for e in entries]
    mine = torch.tensor([len(entries), _digest("\n".join(entries))], dtype=torch.int64)
    rows = _gather(comm, mine).view(ws, 2)
    if bool((rows == rows[0]).all()):
        return
    # Mismatch: everyone saw it, so everyone takes this branch. Find the first differing entry.
    longest = int(rows[:, 0].max())
    padded = torch.zeros(max(longest, 1), dtype=torch.int64)
    padded[: len(hashes)] = torch.tensor(hashes, dtype=torch.int64)
    counts = rows[:, 0].tolist()
    table = _gather(comm, padded).view(ws, -1)
    first = longest
    for j in range(longest):
        present = [j < counts[r] for r in range(ws)]
        if not all(present) or bool((table[:, j] != table[0, j]).any()):
            first = j
            break
    text = entries[first] if first < len(entries) else _NO_ENTRY
    raw = text.encode()[: _DESC_BYTES]
    desc = torch.zeros(_DESC_BYTES, dtype=torch.uint8)
    desc[: len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    descs = _gather(comm, desc)
    texts = [bytes(descs[r * _DESC_BYTES:(r + 1) * _DESC_BYTES].tolist()).rstrip(b"\0")
             .decode(errors="replace") for r in range(ws)]
    differing = [r for r in range(ws) if texts[r] != texts[0] or counts[r] != counts[0]]
    raise ValueError(_mismatch_message(problem, fix, entry, first, texts, counts, differing[0],
                                       len(differing) - 1, limit))


def _words(text: str) -> list[str]:
    # A parenthesised group is one word: "(2, 4)", "strides=(4, 1)".
    return re.findall(r"[^\s(]*\([^)]*\)|\S+", text)


def _mismatch_message(problem: str, fix: str, entry: str | None, first: int, texts: list[str],
                      counts: list[int], other: int, more: int, limit: int) -> str:
    """At most ``limit`` characters naming where rank 0 and rank ``other`` differ."""
    a, b = texts[0], texts[other]
    if a == _NO_ENTRY or b == _NO_ENTRY or not a or not b:
        shown_a, shown_b, context = a, b, entry or ""
        if entry is None:  # name the entry by its first words and show the rest
            words = _words(b if a == _NO_ENTRY else a)
            context, rest = " ".join(words[:2]), " ".join(words[2:])
            shown_a, shown_b = (a, rest) if a == _NO_ENTRY else (rest, b)
    else:
        wa, wb = _words(a), _words(b)
        common = 0
        while common < min(len(wa), len(wb)) and wa[common] == wb[common]:
            common += 1
        context = entry or " ".join(wa[: min(common, 2)])
        if len(wa) == len(wb) and common >= 2:  # same kind and name: only the words that differ
            shown_a = " ".join(x for x, y in zip(wa, wb, strict=True) if x != y)
            shown_b = " ".join(y for x, y in zip(wa, wb, strict=True) if x != y)
        else:
            shown_a, shown_b = " ".join(wa[common:]), " ".join(wb[common:])
    sizes = (f" ({counts[0]} entries)", f" ({counts[other]} entries)") \
        if counts[0] != counts[other] else ("", "")
    tail = f" and {more} more rank(s)" if more else ""

    def build(ctx: str, x: str, y: str, advice: str) -> str:
        return (f"{problem} at {ctx or f'entry {first + 1} of the list'}: rank 0{sizes[0]} has "
                f"{x!r}; rank {other}{sizes[1]} has {y!r}{tail}{advice}")

    # What differs is kept whole where it fits; the entry's name is cut first, then the advice.
    for least in (len(context), min(len(context), 12)):
        for advice in (f"; {fix}", ""):
            room = limit - len(build("", shown_a, shown_b, advice))
            if room >= least:
                return build(brief(context, room), shown_a, shown_b, advice)
    ctx = brief(context, 40)
    room = limit - len(build(ctx, "", "", ""))  # for both texts; a short one leaves more
    room_a = min(len(shown_a), room // 2) if len(shown_b) > room // 2 else room - len(shown_b)
    return brief(build(ctx, brief(shown_a, room_a), brief(shown_b, room - room_a), ""), limit)


def broadcast_tensors(comm: Communicator, tensors: Sequence[torch.Tensor], src: int = 0) -> None:
    """Overwrite ``tensors`` on every rank with rank ``src``'s values, in place.

    Tensors of any dtype and layout-preserving strides are packed byte-wise into uint8 buffers of at
    most 64 MiB per device (one collective per buffer), so dtypes are preserved exactly (int64
    BatchNorm counters stay int64). Zero-size tensors are skipped. No collective at world_size 1.
    """
    if comm.world_size == 1:
        return
    chunks: list[list[torch.Tensor]] = []
    sizes: list[int] = []
    keys: list[torch.device] = []
    for t in tensors:
        if t.numel() == 0:
            continue
        nbytes = t.numel() * t.element_size()
        padded = -(-nbytes // _ALIGN) * _ALIGN
        for k, dev in enumerate(keys):
            if dev == t.device and sizes[k] + padded <= _CHUNK_BYTES:
                chunks[k].append(t)
                sizes[k] += padded
                break
        else:
            keys.append(t.device)
            chunks.append([t])
            sizes.append(padded)
    with torch.no_grad():
        for dev, group, total in zip(keys, chunks, sizes, strict=True):
            flat = torch.empty(total, dtype=torch.uint8, device=dev)
            slots = []
            off = 0
            for t in group:
                nbytes = t.numel() * t.element_size()
                slots.append(flat[off:off + nbytes].view(t.dtype).view(t.shape))
                off += -(-nbytes // _ALIGN) * _ALIGN
            if comm.rank == src:
                for t, slot in zip(group, slots, strict=True):
                    slot.copy_(t)
            comm.broadcast(flat, src)
            if comm.rank != src:
                for t, slot in zip(group, slots, strict=True):
                    t.copy_(slot)
