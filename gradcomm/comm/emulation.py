"""Reductions the transports lack, built from those they have.

* ``ReduceOp.AVG`` as SUM, then divide (:func:`average`), for backends whose
  ``native_reduce_ops`` lack it: all_reduce, reduce and reduce_scatter alike.
* SUM and AVG of complex tensors as the same op on their real view (:func:`reduce_complex`), as
  torch.distributed does for backends without complex support. No transport here reduces complex
  numbers, and MIN, MAX and PRODUCT are not element-wise on that view.

Each takes the transport's operation as a function, so one algorithm serves every backend.
:func:`emulated` and :func:`complex_support` phrase what these emulations mean for
:meth:`~gradcomm.comm.Communicator.supports`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .types import ReduceOp, Support, SupportLevel
from .work import DescriptionLike, Work, writing_into

__all__ = ["average", "complex_support", "emulated", "reduce_complex"]

#: A communicator's public all_reduce: ``(tensor, op, *, async_op, label) -> Work``.
AllReduce = Callable[..., Work]


def average(
    start: Callable[[torch.Tensor, torch.Tensor, ReduceOp, DescriptionLike], Work],
    world_size: int,
    output: torch.Tensor,
    input: torch.Tensor,
    description: DescriptionLike,
) -> Work:
    """Start AVG as ``start(output, input, ReduceOp.SUM, description)``, then divide ``output``
    by ``world_size``.

    ``start`` is a backend's reduction hook (all_reduce's and reduce's in place: ``input`` is
    ``output``). 16-bit floats are summed in float32 copies and rounded once at the end, so an
    average of in-range values never overflows (fp16 40000 + 40000 would) and matches the float32
    reference cast back to the dtype. The division runs on every rank; for ``reduce`` only the
    root's ``output`` holds a defined value.
    """
    if output.dtype in (torch.float16, torch.bfloat16):
        if input is output:  # in place: one float32 copy is both
            wide_out = wide_in = output.to(torch.float32)
        else:
            wide_out = torch.empty_like(output, dtype=torch.float32)
            wide_in = input.to(torch.float32)
        work = start(wide_out, wide_in, ReduceOp.SUM, description)
        work.add_callback(lambda: output.copy_(wide_out.div_(world_size)))
    else:
        work = start(output, input, ReduceOp.SUM, description)
        work.add_callback(lambda: output.div_(world_size))
    return work


def reduce_complex(
    all_reduce: AllReduce, tensor: torch.Tensor, op: ReduceOp, label: str | None
) -> Work:
    """Start SUM or AVG of the complex ``tensor`` as that op on its real view
    (:func:`torch.view_as_real`: real and imaginary parts are reduced independently).

    ``all_reduce`` is the communicator's public all_reduce, so the real view takes the same
    checked, profiled path as any tensor. The returned work is asynchronous.

    Raises:
        TypeError: ``op`` is neither SUM nor AVG.
    """
    if op not in (ReduceOp.SUM, ReduceOp.AVG):
        raise TypeError(f"all_reduce: complex tensors ({tensor.dtype}) can be reduced with "
                        f"SUM or AVG, not {op.name}")
    # A conjugate view has no real view: reduce its resolved copy and write that back.
    buf = tensor.resolve_conj() if tensor.is_conj() else tensor
    work = all_reduce(torch.view_as_real(buf), op, async_op=True, label=label)
    if buf is not tensor:
        if work.is_completed():
            with writing_into(tensor):
                tensor.copy_(buf)
        else:
            work.add_callback(lambda: tensor.copy_(buf))
    return work


def complex_support(
    dtype: torch.dtype,
    device: torch.device | None,
    supports: Callable[[torch.dtype, torch.device | None], Support],
) -> Support:
    """The answer of ``supports`` for the real dtype of the complex ``dtype`` (complex64:
    float32), with a reason saying that the real view is reduced."""
    real = torch.empty(0, dtype=dtype).real.dtype
    part = supports(real, device)
    if not part.is_supported:
        return part
    why = f"{dtype} is reduced (SUM or AVG only) as its {real} real view (torch.view_as_real)"
    return Support(part.level, f"{why}; {part.reason}" if part.reason else why,
                   part.transfer_dtype)


def emulated(base: Support, how: str) -> Support:
    """``base`` downgraded to EMULATED_SLOW (if supported at all), with ``how`` in its reason."""
    if not base.is_supported:
        return base
    reason = f"{how}; {base.reason}" if base.reason else how
    return Support(SupportLevel.EMULATED_SLOW, reason, base.transfer_dtype)
