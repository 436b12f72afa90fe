"""Argument checks of the pure JAX functions (`losses`, `corrections`, `_isotonic`), one style for all.

As rlax does: an array's structure (rank, shape, dtype) is checked with chex
asserts on a function's first lines. Shapes and dtypes are static, so the
checks run once, at trace time, and cost nothing under jit. A failure raises
AssertionError; chex's message says what it found, the appended
``[<argument>: expected ...]`` names the argument and what was expected:

    [Chex] Assertion assert_rank failed: ... input 0 has rank 1 (shape (8,)) but expected 2.
    [rewards: expected shape [n, m] ([N groups, G rollouts])]

A value that is wrong (a coefficient out of range, an unknown option) raises
ValueError naming the argument, the value it got and what was expected:
``eps: 0.0, expected a finite number > 0.0``.

Imports only chex and jax, like the modules that use it.
"""

from __future__ import annotations

import numbers

import chex
import jax
import jax.numpy as jnp

Array = jax.Array

_KINDS = {"float": float, "bool": bool}


def _shape_text(shape: tuple) -> str:
    letters = iter("nmkl")
    return "[" + ", ".join(next(letters) if s is None else str(s) for s in shape) + "]"


def check_array(name: str, a, kind: str | None, shape: tuple, what: str = "") -> Array:
    """``a`` as an array, asserted (chex) to have ``shape`` and a ``kind`` dtype; returns it.

    kind: "float" (any floating dtype), "bool", or None (any dtype); shape: a tuple whose None
    entries match any size; what: words for the message ("like rewards").
    """
    a = jnp.asarray(a)
    expected = f"{name}: expected shape {_shape_text(shape)}" + (f" ({what})" if what else "")
    chex.assert_rank(a, len(shape), custom_message=expected)
    chex.assert_shape(a, shape, custom_message=expected)
    if kind is not None:
        chex.assert_type(a, _KINDS[kind], custom_message=f"{name}: expected a {kind} dtype")
    return a


def check_number(name: str, value, lowest: float, *, strict: bool = False) -> None:
    """A finite real number >= lowest (> lowest when strict), else ValueError; arrays (traced or not) pass."""
    if not isinstance(value, numbers.Real):
        return
    ok = value > lowest if strict else value >= lowest
    if not (ok and abs(float(value)) < float("inf")):
        raise ValueError(f"{name}: {value!r}, expected a finite number {'>' if strict else '>='} {lowest}")


def check_int(name: str, value, lowest: int) -> None:
    """An int (not a bool) >= lowest, else ValueError."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < lowest:
        raise ValueError(f"{name}: {value!r}, expected an int >= {lowest}")


def check_choice(name: str, value, choices: tuple) -> None:
    """One of ``choices``, else ValueError."""
    if value not in choices:
        raise ValueError(f"{name}: {value!r}, expected one of {choices}")


__all__ = ["check_array", "check_choice", "check_int", "check_number"]
