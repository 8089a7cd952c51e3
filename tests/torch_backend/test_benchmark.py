"""benchmarks/torch_backend.py's arguments and table (its timed runs need mpiexec and minutes:
docs/torch-backend.md gives the command and the measured tables)."""

from __future__ import annotations

import pytest

from tests._support.dist_utils import benchmark_module


def test_arguments_and_ratio_table() -> None:
    bench = benchmark_module("torch_backend")
    args = bench.parse_args(["--transport", "gloo", "--models", "mlp,conv", "--runs", "2"])
    assert (args.transport, args.models, args.runs, args.fsdp) == ("gloo", "mlp,conv", 2, True)
    with pytest.raises(SystemExit):
        bench.parse_args(["--models", "resnet"])  # argparse reports the unknown model
    assert bench.RATIOS[0] == ("ddp+gradcomm", "ddp+gloo")
