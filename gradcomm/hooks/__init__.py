"""gradcomm.hooks: the gradient hook manager and its comm hooks.

:class:`GradientReducer` averages gradients across ranks during ``loss.backward()``;
:func:`apply_gradient_allreduce` is the old one-call entry point; :mod:`.comm_hooks` holds the
ways a bucket can be summed (plain all-reduce, fp16/bf16 compression, or your own), and
:mod:`.powersgd` the PowerSGD low-rank compression hook; :class:`ShardedOptimizer` shards the
optimizer state and gradients across ranks (ZeRO stages 1 and 2).
"""

from ._apply import apply_gradient_allreduce
from .choice import CommHook
from .comm_hooks import (
    CommHookFn,
    GradBucket,
    allreduce_hook,
    bf16_compress_hook,
    bf16_compress_wrapper,
    compress_wrapper,
    fp16_compress_hook,
    fp16_compress_wrapper,
)
from .powersgd import PowerSGDState, powersgd_hook
from .reducer import BucketInfo, GradientReducer
from .sharded import ShardedOptimizer

__all__ = [
    "GradientReducer",
    "ShardedOptimizer",
    "BucketInfo",
    "apply_gradient_allreduce",
    "CommHook",
    "CommHookFn",
    "GradBucket",
    "allreduce_hook",
    "fp16_compress_hook",
    "bf16_compress_hook",
    "compress_wrapper",
    "fp16_compress_wrapper",
    "bf16_compress_wrapper",
    "PowerSGDState",
    "powersgd_hook",
]
