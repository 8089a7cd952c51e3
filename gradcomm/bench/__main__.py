"""``python -m gradcomm.bench``: all-reduce sweep in the nccl-tests format, with the raw transport.

Examples::

    mpiexec -n 2 python -m gradcomm.bench --backend gloo --backend mpi --json sweep.json
    torchrun --nproc-per-node 2 -m gradcomm.bench -b 8 -e 256M --csv sweep.csv
    torchrun --nproc-per-node 2 -m gradcomm.bench --backend nccl        # buffers on cuda:<rank>
    mpiexec -n 2 python -m gradcomm.bench --backend mpi --device cuda   # MPI with GPU buffers
    python -m gradcomm.bench --plot busbw.png sweep-*.json     # plot saved runs, no launch
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    """The command line (options named after nccl-tests' ``all_reduce_perf`` where it has one)."""
    from .metrics import parse_size

    def size_arg(text: str) -> int:
        try:
            return parse_size(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    p = argparse.ArgumentParser(
        prog="python -m gradcomm.bench",
        description=(
            "All-reduce sweep in the nccl-tests format (size, count, type, redop, time, algbw, "
            "busbw = algbw * 2(n-1)/n), gradcomm beside the raw transport it runs on. Launch "
            "with mpiexec or torchrun; rank 0 prints. Given JSON files, only plots them."
        ),
    )
    p.add_argument("results", nargs="*", type=Path, metavar="JSON",
                   help="saved --json results to plot with --plot (no benchmark is run)")
    p.add_argument("-b", "--minbytes", type=size_arg, default=8,
                   help="smallest message in bytes; K/M/G suffixes are powers of 1024 (default 8)")
    p.add_argument("-e", "--maxbytes", type=size_arg, default=64 * 1024**2,
                   help="largest message in bytes (default 64M; 256M works but is slow here)")
    p.add_argument("-f", "--stepfactor", type=float, default=2.0,
                   help="multiply the size by this per step (default 2)")
    p.add_argument("-d", "--dtype", default="float32",
                   help="float32 (float), float64 (double), float16 (half), bfloat16, int8, "
                        "uint8, int32, int64 (default float32)")
    p.add_argument("-o", "--op", default="sum", help="sum, prod, min, max or avg (default sum)")
    p.add_argument("-c", "--collective", action="append", default=None,
                   help="collective(s) to sweep, comma-separated: all_reduce (default), "
                        "reduce_scatter, all_gather, all_to_all, broadcast, reduce, gather, "
                        "scatter, sendrecv (send/recv ring), or all")
    p.add_argument("-n", "--iters", type=int, default=20, help="timed calls per round (default 20)")
    p.add_argument("-w", "--warmup", type=int, default=5, help="untimed calls first (default 5)")
    p.add_argument("-r", "--repeats", type=int, default=3,
                   help="interleaved rounds of gradcomm and raw; median reported (default 3)")
    p.add_argument("--stat", choices=("median", "min", "call-median"), default="median",
                   help="time reported: median (default) or min over rounds of the mean per "
                        "call (nccl-tests' time), or call-median: median of single calls; "
                        "min and call-median filter out calls slowed by other processes")
    p.add_argument("--backend", action="append", default=None,
                   help="gradcomm backend; repeat for several (default: gradcomm's rule, "
                        "GRADCOMM_BACKEND, else nccl with CUDA, else gloo)")
    p.add_argument("--device", default=None,
                   help="device of the buffers, passed to gradcomm.init: cpu, cuda or cuda:<i> "
                        "(default: the backend's, cpu for gloo and mpi, cuda:<local_rank> for "
                        "nccl and cupy-nccl); mpi with cuda passes GPU buffers")
    p.add_argument("--no-raw", action="store_true", help="skip the raw transport's column")
    p.add_argument("--timeout", type=float, default=300.0,
                   help="seconds per collective before giving up (default 300)")
    p.add_argument("--json", type=Path, default=None, help="write the results as JSON here")
    p.add_argument("--csv", type=Path, default=None, help="write the results as CSV here")
    p.add_argument("--plot", type=Path, default=None,
                   help="draw busbw against size to this image (needs matplotlib)")
    return p


def _check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.results and args.plot is None:
        p.error("JSON files were given: add --plot OUT.png to plot them")
    if args.iters < 1 or args.repeats < 1 or args.warmup < 0:
        p.error("need --iters >= 1, --repeats >= 1 and --warmup >= 0")
    if args.minbytes < 1 or args.maxbytes < args.minbytes:
        p.error("need 1 <= --minbytes <= --maxbytes")
    if not 1 < args.stepfactor < math.inf:  # NaN fails too
        p.error(f"--stepfactor must be a finite number > 1, got {args.stepfactor}")
    for flag, path in (("--json", args.json), ("--csv", args.csv), ("--plot", args.plot)):
        if path is not None and path.is_dir():
            p.error(f"{flag} {path} is a folder; give a file name")
        if path is not None and not path.resolve().parent.is_dir():  # before the sweep, not after
            p.error(f"{flag} {path}: the folder {path.resolve().parent} does not exist")
    if args.device is not None:
        import torch

        try:
            device = torch.device(args.device)
        except (RuntimeError, ValueError) as exc:
            p.error(f"--device {args.device!r} is not a torch device: {exc}")
        if device.type not in ("cpu", "cuda"):
            p.error(f"--device must be cpu, cuda or cuda:<i>, got {args.device!r}")


def _plot_only(args: argparse.Namespace) -> int:
    from .plot import plot_busbw
    from .results import read_json

    results = [read_json(path) for path in args.results]
    labels = plot_busbw(results, args.plot)
    print(f"wrote {args.plot}: {', '.join(labels)}")
    return 0


def _launch_prefix(launcher: str, world_size: int) -> list[str]:
    """The launcher part of the command that reproduces this run (``launcher``: a
    :class:`gradcomm.comm.Launcher` value), for the JSON's ``command``."""
    from ..comm.launch.launcher import Launcher

    n = str(world_size)
    if launcher == Launcher.TORCHRUN.value:
        return ["torchrun", "--nproc-per-node", n]
    if Launcher(launcher).is_mpi:
        return ["mpiexec", "-n", n]
    if launcher == Launcher.SLURM.value:
        return ["srun", "-n", n]
    return []


def _meta(args: argparse.Namespace, world_size: int, launcher: str) -> dict[str, Any]:
    from .results import run_metadata

    return {
        "tool": "gradcomm.bench",
        "collective": ",".join(args.collective or ["all_reduce"]),
        **run_metadata([*_launch_prefix(launcher, world_size), "python", "-m", "gradcomm.bench",
                        *sys.argv[1:]]),
        "world_size": world_size,
        "launcher": launcher,
        "dtype": args.dtype,
        "op": args.op,
        "iters": args.iters,
        "warmup": args.warmup,
        "repeats": args.repeats,
        "stat": args.stat,
        "device": args.device,
        "time": f"max over ranks of each rank's {args.stat} (see --stat)",
        "busbw": "algbw * nccl-tests' factor (doc/PERFORMANCE.md): all_reduce 2(n-1)/n; "
                 "reduce_scatter, all_gather, all_to_all, gather, scatter (n-1)/n; broadcast, "
                 "reduce 1",
    }


def main(argv: Sequence[str] | None = None) -> int:
    """Run the sweep (or, given JSON files, only plot them); return the exit status.

    Usage errors -- an unknown dtype, op or backend, ``--op avg`` on integers, a bad
    ``--timeout`` or ``--stepfactor``, an output folder that does not exist, a backend whose
    package or GPU is missing, a ``--device`` the backend cannot use, ``--plot`` without
    matplotlib -- exit with status 2 and argparse's message on every rank, before any
    collective.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    _check_args(parser, args)
    if args.plot is not None:  # fail before any rendezvous, on every rank
        from .plot import require_matplotlib

        try:
            require_matplotlib()
        except ImportError as exc:
            parser.error(str(exc))
    if args.results:
        return _plot_only(args)

    import torch

    from .. import comm as gc
    from ..comm.launch.registry import check_backend, known_backends, normalize_backend_name
    from ..comm.launch.selection import resolve_timeout
    from ..comm.types import Collective, ReduceOp
    from .collectives import SWEPT, run_collective_sweep
    from .metrics import dtype_name, parse_dtype, size_sweep
    from .results import SweepResult, format_table, mpi_versions, write_csv, write_json
    from .sweep import make_raw_transport, raw_transport_unavailable, run_sweep

    try:  # bad names are usage errors, reported alike on every rank before any rendezvous
        dtype = parse_dtype(args.dtype)
        op = ReduceOp.coerce("product" if args.op.strip().lower() == "prod" else args.op)
        backends = []
        for entry in args.backend or [gc.select_backend().name]:
            backends += [normalize_backend_name(b) for b in entry.split(",")
                         if b.strip()]
        unknown = [b for b in backends if b not in known_backends()]
        if unknown:
            raise ValueError(f"unknown backend(s) {', '.join(unknown)}; known: "
                             f"{', '.join(known_backends())}")
        for name in backends:
            check_backend(name)  # a missing package or GPU, before any rendezvous
        if op is ReduceOp.AVG and not (dtype.is_floating_point or dtype.is_complex):
            raise ValueError(f"--op avg needs a floating-point --dtype, got {args.dtype}")
        resolve_timeout(args.timeout)  # --timeout, else GRADCOMM_TIMEOUT
        collectives: list[Collective] = []
        for entry in args.collective or ["all_reduce"]:
            for name in (n.strip() for n in entry.split(",") if n.strip()):
                collectives += ([Collective.ALL_REDUCE, *SWEPT] if name.lower() == "all"
                                else [Collective.coerce(name)])
        unswept = [c.value for c in collectives if c is not Collective.ALL_REDUCE
                   and c not in SWEPT]
        if unswept:
            raise ValueError(f"no sweep of {', '.join(unswept)}")
    except (ValueError, TypeError, ImportError, RuntimeError) as exc:
        parser.error(str(exc))
    elem = torch.empty((), dtype=dtype).element_size()
    sizes = size_sweep(args.minbytes, args.maxbytes, args.stepfactor, elem)
    if not sizes:
        parser.error(f"no size between --minbytes and --maxbytes holds one {args.dtype} element")
    launch = gc.detect_launch()
    rank0 = launch.rank == 0

    def say(line: str) -> None:
        if rank0:
            print(line, flush=True)

    result = SweepResult(meta=_meta(args, launch.world_size, launch.launcher.value))
    result.meta["backends"] = backends
    names = ",".join(c.value for c in collectives)
    say(f"# gradcomm.bench {names}: {launch.world_size} ranks ({launch.launcher.value}), "
        f"{dtype_name(dtype)} {args.op}, sizes {sizes[0]}..{sizes[-1]} B, iters {args.iters}, "
        f"warmup {args.warmup}, repeats {args.repeats}, OMP_NUM_THREADS="
        f"{os.environ.get('OMP_NUM_THREADS', 'unset')}")
    say(f"# time: max over ranks of the {args.stat} per call over {args.repeats} rounds; "
        "busbw = algbw * nccl-tests' factor: all_reduce 2(n-1)/n; reduce_scatter, all_gather, "
        "all_to_all, gather, scatter (n-1)/n; broadcast, reduce, sendrecv 1")
    if launch.world_size == 1:
        say("# world_size 1: gradcomm issues no collective (all_reduce returns at once), while the "
            "raw column is the transport's own 1-rank call, so ratio and overhead compare "
            "unlike things here; launch 2+ ranks (mpiexec -n 2 / torchrun --nproc-per-node 2)")
    for name in backends:
        try:
            comm = gc.init(name, timeout=args.timeout, device=args.device)
        except ValueError as exc:  # e.g. --device cuda for gloo: raised before any rendezvous
            parser.error(str(exc))
        if args.device is not None and comm.device.type != torch.device(args.device).type:
            comm.close()  # every rank gets here alike: a usage error, not a hang
            parser.error(f"the {name} backend works on {comm.device.type}, not --device "
                         f"{args.device}")
        raw = None if args.no_raw else make_raw_transport(comm, args.timeout)
        try:
            say("#")
            say(f"# {comm.backend} on {comm.device}")
            result.meta.setdefault("devices", {})[comm.backend] = str(comm.device)
            if not args.no_raw and raw is None:
                say(f"# no raw column: {raw_transport_unavailable(comm)}")
            if raw is not None:
                say(f"# raw column: {raw.description}")
            if raw is not None and not raw.supports(dtype, op):
                say(f"# {raw.name} cannot reduce {dtype_name(dtype)} with {args.op}: "
                    "no raw column")
            rows = []
            for collective in collectives:
                header_done = False

                def show(row: Any) -> None:
                    nonlocal header_done
                    lines = format_table([row])
                    if not header_done:
                        for line in lines[:-1]:
                            say(line)
                        header_done = True
                    say(lines[-1])

                if len(collectives) > 1:
                    say(f"# {collective.value}")
                if collective is Collective.ALL_REDUCE:
                    rows += run_sweep(comm, sizes, dtype, op, iters=args.iters,
                                      warmup=args.warmup, repeats=args.repeats, raw=raw,
                                      progress=show, stat=args.stat)
                else:
                    rows += run_collective_sweep(
                        comm, collective, sizes, dtype, op, iters=args.iters,
                        warmup=args.warmup, repeats=args.repeats, raw=raw, progress=show,
                        stat=args.stat)
            result.rows += rows
            wrong = sum(r.wrong for r in rows)
            verdict = "OK" if wrong == 0 else "FAILED"
            say(f"# {comm.backend}: out of bounds values: {wrong} {verdict}")
        finally:
            if raw is not None:
                raw.close()
            comm.close()
    if rank0:
        result.meta["mpi"] = mpi_versions()  # the mpi backend may have loaded MPI since the start
        if args.json is not None:
            write_json(result, args.json)
            print(f"# wrote {args.json}")
        if args.csv is not None:
            write_csv(result.rows, args.csv)
            print(f"# wrote {args.csv}")
        if args.plot is not None:
            from .plot import plot_busbw

            plot_busbw([result], args.plot)
            print(f"# wrote {args.plot}")
    return 1 if any(r.wrong for r in result.rows) else 0


if __name__ == "__main__":
    sys.exit(main())
