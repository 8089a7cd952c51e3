"""The public surface: what ``import gradcomm`` exports, the test-only thread backend kept out of
it, and error messages of at most 200 characters (details live in docs/failures.md)."""

from __future__ import annotations

import ast
import builtins
import importlib
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import gradcomm
from gradcomm.comm import CollectiveTimeoutError, Communicator
from gradcomm.comm.backends.threads import ThreadGroup
from gradcomm.comm.launch.registry import known_backends
from gradcomm.hooks import GradientReducer

PACKAGE = Path(gradcomm.__file__).parent
LIMIT = 200
# A placeholder adds at least a few characters at run time; the long ones (descriptions, names,
# quoted errors) are checked at run time below.
PLACEHOLDER = 4
_EXCEPTIONS = {n for n, v in vars(builtins).items()
               if isinstance(v, type) and issubclass(v, BaseException)}


def test_top_level_exports_at_most_15_names_that_all_resolve() -> None:
    assert len(gradcomm.__all__) <= 15, gradcomm.__all__
    for name in gradcomm.__all__:
        assert hasattr(gradcomm, name), name
    public = {n for n in vars(gradcomm) if not n.startswith("_")}
    # Besides __all__ only the subpackages are reachable as attributes.
    assert public - set(gradcomm.__all__) <= {"comm", "hooks", "profiler", "bench", "info",
                                              "elastic", "torch_backend"}, public


@pytest.mark.parametrize("module", ["gradcomm.comm", "gradcomm.hooks", "gradcomm.profiler",
                                    "gradcomm.bench", "gradcomm.elastic"])
def test_submodules_import_and_export_what_they_list(module: str) -> None:
    mod = importlib.import_module(module)
    # gradcomm.comm is the whole collective interface (ops, P2POp, Collective, DebugLevel, ...)
    assert len(mod.__all__) <= 24, (module, mod.__all__)
    for name in mod.__all__:
        assert hasattr(mod, name), (module, name)


def test_thread_backend_is_a_test_double_not_a_backend() -> None:
    assert "threads" not in known_backends()
    assert "threads" not in gradcomm.available_backends()
    with pytest.raises(ValueError, match="unknown gradcomm backend"):
        gradcomm.init("threads", world_size=1, rank=0, env={})


# ----------------------------------------------------------------------------- messages
def _parts(node: ast.expr) -> tuple[int, int] | None:
    """(literal characters, placeholders) of a message expression, None if not a literal."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return len(node.value), 0
    if isinstance(node, ast.JoinedStr):
        return (sum(len(v.value) for v in node.values if isinstance(v, ast.Constant)),
                sum(isinstance(v, ast.FormattedValue) for v in node.values))
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left, right = _parts(node.left), _parts(node.right)
        if left and right:
            return left[0] + right[0], left[1] + right[1]
        if left or right:
            lit = left or right
            assert lit is not None
            return lit[0], lit[1] + 1
    return None


def _messages() -> list[tuple[str, int, int]]:
    """Every literal message given to an exception or warning in the package:
    (where, estimated length, placeholders)."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not (isinstance(node, ast.Call) and node.args):
                continue
            f = node.func
            name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) \
                else ""
            if name in _EXCEPTIONS or name.endswith(("Error", "Exception", "Warning")) \
                    or name == "warn":
                parts = _parts(node.args[0])
                if parts is not None:
                    where = f"{path.relative_to(PACKAGE.parent)}:{node.lineno}"
                    found.append((where, parts[0] + PLACEHOLDER * parts[1], parts[1]))
    return found


def test_every_literal_error_message_is_at_most_200_characters() -> None:
    messages = _messages()
    assert len(messages) > 150  # the scan sees the package's raises
    long = [(where, n) for where, n, _ in messages if n > LIMIT]
    assert not long, f"messages over {LIMIT} characters (move the details to docs/failures.md): " \
                     f"{long}"


def _errors_on_ranks(world_size: int, fn: Callable[[Communicator], Any]) -> list[BaseException]:
    def body(comm: Communicator) -> Any:
        try:
            fn(comm)
        except Exception as exc:  # noqa: BLE001 - the test inspects it
            return exc
        return None

    out = ThreadGroup(world_size, timeout=20).run(body)
    assert all(isinstance(e, Exception) for e in out), out
    return out


class _LongNames(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.encoder_block_with_a_rather_long_descriptive_name = nn.ModuleList(
            [nn.Linear(4, width), nn.Linear(width, 2)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.encoder_block_with_a_rather_long_descriptive_name:
            x = layer(x)
        return x


def _short(errors: list[BaseException], *fragments: str) -> None:
    for err in errors:
        text = str(err)
        assert len(text) <= LIMIT, (len(text), text)
        for frag in fragments:
            assert frag in text, (frag, text)


def test_model_mismatch_with_long_names_is_short_and_names_the_difference() -> None:
    errors = _errors_on_ranks(3, lambda comm: GradientReducer(_LongNames(3 + comm.rank), comm))
    _short(errors, "differs across ranks", "(3, 4)", "(4, 4)", "rank 1")


def test_bucket_option_mismatch_is_short_and_says_what_to_do() -> None:
    errors = _errors_on_ranks(2, lambda comm: GradientReducer(
        _LongNames(3), comm, first_bucket_cap_mb=1.0 + comm.rank, in_place_min_mb=float(comm.rank)))
    _short(errors, "first_bucket_cap_mb", "explicitly, the same on every rank")


def test_comm_hook_mismatch_is_short() -> None:
    def fn(comm: Communicator) -> None:
        model = _LongNames(3)
        reducer = GradientReducer(model, comm)
        reducer.register_comm_hook("fp16_compress" if comm.rank else "allreduce")
        model(torch.ones(2, 4)).sum().backward()

    _short(_errors_on_ranks(2, fn), "comm hook differs across ranks", "fp16_compress_hook")


def test_replaced_parameter_with_a_long_name_is_short() -> None:
    def fn(comm: Communicator) -> None:
        model = _LongNames(3)
        GradientReducer(model, comm)
        model.encoder_block_with_a_rather_long_descriptive_name[1].weight = nn.Parameter(
            torch.zeros(2, 3))
        model(torch.ones(2, 4))

    _short(_errors_on_ranks(2, fn), "was replaced", "after the GradientReducer was built")


def test_timeout_and_stalled_communicator_messages_are_short() -> None:
    joined = threading.Event()
    # As long as GradBucket.label() makes them: the first names cut to 40 characters.
    label = "bucket 7 (encoder_block_with_a_rather_lo... and 5 more)"

    def body(comm: Communicator) -> list[BaseException]:
        t = torch.ones(1000)
        if comm.rank == 1:  # joins only after rank 0's wait has timed out
            joined.wait(30)
            comm.all_reduce(t, label=label)
            return []
        work = comm.all_reduce(t, async_op=True, label=label)
        errors: list[BaseException] = []
        try:
            work.wait(timeout=0.5)
        except CollectiveTimeoutError as exc:
            errors.append(exc)
        try:
            comm.all_reduce(torch.ones(2))  # refused while the timed-out one is pending
        except RuntimeError as exc:
            errors.append(exc)
        joined.set()
        work.wait()
        return errors

    errors, _ = ThreadGroup(2, timeout=20).run(body)
    assert len(errors) == 2, errors
    _short(errors[:1], "did not complete within 0.5 s", "bucket 7")
    _short(errors[1:], "unusable while", "still pending")


class _FailedTorchWork:
    """A torch Work that failed with gloo's kind of message (a source path, then advice)."""

    def is_completed(self) -> bool:
        return True

    def wait(self, timeout: object = None) -> bool:
        raise RuntimeError("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553]"
                           " Connection closed by peer [127.0.0.1]:12345. " + "advice " * 30)


def test_a_transport_failure_quoted_by_a_work_is_short() -> None:
    from gradcomm.comm.backends.torch_dist import TorchWork

    work = TorchWork(_FailedTorchWork(), "all_reduce #3 SUM of 4 torch.float32 on cpu " * 4,  # type: ignore[arg-type]
                     300.0)
    with pytest.raises(RuntimeError) as info:
        work.wait()
    message = str(info.value)
    assert len(message) <= 200, (len(message), message)
    assert message.startswith("all_reduce #3") and "Connection closed by peer" in message, message


def test_a_device_torch_does_not_know_is_refused_briefly() -> None:
    with pytest.raises(ValueError, match="is not a torch device") as info:
        gradcomm.init("gloo", device="tpu", rank=0, world_size=1)
    assert len(str(info.value)) <= 200, str(info.value)
