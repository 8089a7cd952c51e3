"""On/off switches read from ``GRADCOMM_*`` environment variables: one parser for all of them.

The same words mean on and off for every switch, and a value that is neither is an error, not a
silent default (a typo in a job script must not quietly change what the job does).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import overload

__all__ = ["ON_WORDS", "OFF_WORDS", "env_flag"]

#: Values (any case, blanks around them ignored) that turn a switch on.
ON_WORDS = ("1", "true", "yes", "on")
#: Values (any case, blanks around them ignored) that turn a switch off.
OFF_WORDS = ("0", "false", "no", "off")


@overload
def env_flag(name: str, default: bool, env: Mapping[str, str] | None = None) -> bool: ...


@overload
def env_flag(name: str, default: None, env: Mapping[str, str] | None = None) -> bool | None: ...


def env_flag(name: str, default: bool | None, env: Mapping[str, str] | None = None) -> bool | None:
    """The on/off value of environment variable ``name``.

    Args:
        name: the variable, e.g. ``"GRADCOMM_PROFILE"``.
        default: what an unset or empty (blank) variable means; None lets the caller tell "not
            set" from a choice (e.g. detect instead).
        env: environment to read (default :data:`os.environ`).

    Returns:
        True for one of :data:`ON_WORDS`, False for one of :data:`OFF_WORDS`, else ``default``
        when the variable is unset or blank.

    Raises:
        ValueError: any other value; the message names the variable, the value and the words.
    """
    env = os.environ if env is None else env
    raw = env.get(name, "")
    word = raw.strip().lower()
    if not word:
        return default
    if word in ON_WORDS:
        return True
    if word in OFF_WORDS:
        return False
    raise ValueError(f"{name} must be one of {'/'.join(ON_WORDS)} (on) or {'/'.join(OFF_WORDS)} "
                     f"(off), any case; got {raw!r}")
