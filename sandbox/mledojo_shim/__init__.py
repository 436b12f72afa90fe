"""A stand-in for `mledojo.metrics.base`, so MLE-Dojo's `utils/metric.py` files load unchanged.

MLE-Dojo's competition metrics start with

    from mledojo.metrics.base import CompetitionMetrics, InvalidSubmissionError

The real package pulls in its agents, gym and chat stack; grading needs only
these two names. `install()` registers `mledojo`, `mledojo.metrics` and
`mledojo.metrics.base` in `sys.modules` when the real package is absent, and
does nothing when it is installed (then the real classes are used).
"""

from __future__ import annotations

import importlib
import sys
import types

from sandbox.mledojo_shim import base

_installed_shim = False


def install() -> bool:
    """Make `import mledojo.metrics.base` work. Returns True when the shim is in use."""
    global _installed_shim
    if _installed_shim:
        return True
    try:
        importlib.import_module("mledojo.metrics.base")
        return False
    except ImportError:
        pass
    pkg = types.ModuleType("mledojo")
    pkg.__path__ = []   # a namespace-like package: only `metrics` below exists
    pkg.__doc__ = "wmrl-jax shim of the MLE-Dojo package (metrics.base only)."
    metrics = types.ModuleType("mledojo.metrics")
    metrics.__path__ = []
    metrics.base = base
    pkg.metrics = metrics
    sys.modules.setdefault("mledojo", pkg)
    sys.modules.setdefault("mledojo.metrics", metrics)
    sys.modules.setdefault("mledojo.metrics.base", base)
    _installed_shim = True
    return True


__all__ = ["install", "base"]
