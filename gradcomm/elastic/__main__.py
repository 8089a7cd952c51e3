"""``python -m gradcomm.elastic``: serve the coordinator of fault-tolerant jobs (a torch
``TCPStore``, see :mod:`gradcomm.elastic.coordinator`) from this process until SIGINT or SIGTERM.

    python -m gradcomm.elastic --port 29400             # prints its address
    python -m gradcomm.elastic --port 0 --address-file coordinator.txt   # any free port
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from collections.abc import Sequence
from pathlib import Path

from .coordinator import serve


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m gradcomm.elastic``: serve a coordinator until SIGINT or SIGTERM."""
    parser = argparse.ArgumentParser(
        prog="python -m gradcomm.elastic",
        description="Serve the coordinator (a torch TCPStore) of fault-tolerant gradcomm jobs.")
    parser.add_argument("--host", default="0.0.0.0", help="address to listen on (default all)")
    parser.add_argument("--port", type=int, default=29400,
                        help="TCP port (default 29400; 0: any free port, printed)")
    parser.add_argument("--address-file", type=Path, default=None,
                        help="also write 'host:port' to this file once listening")
    args = parser.parse_args(argv)
    if not 0 <= args.port < 65536:
        parser.error("--port must be in 0..65535")
    store = serve(args.host, args.port)
    shown = "127.0.0.1" if args.host in ("0.0.0.0", "") else args.host
    address = f"{shown}:{store.port}"
    if args.address_file is not None:
        tmp = args.address_file.with_suffix(".tmp")
        tmp.write_text(address + "\n")
        tmp.replace(args.address_file)  # readers never see a partial address
    print(f"gradcomm elastic coordinator listening on {address}", flush=True)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    while not stop.wait(1.0):  # a timed wait lets the signal handlers run
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
