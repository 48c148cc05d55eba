"""A test switch that reproduces a CPU whose GEMM kernels change at 3 rows.

On an AMD EPYC machine (torch 2.13.0+cpu, MKL, AVX512) a linear of 1-3 rows rounds differently
from one of 4 or more: row 0 of a 64x96 weight differed by up to 4.8e-6 between M = 3 and
M >= 4 (M >= 4 equal to each other). A test that compares runs of different shapes bit for bit
passes on a machine without that switch and fails there.

``SHARDGEN_TEST_SMALL_ROWS=1`` makes every machine behave so: every ``F.linear`` (``nn.Linear``,
shardgen's stationary and chunked products, which call ``F.linear`` on their row blocks) and every
2-D ``torch.addmm`` (GPT-2's ``Conv1D``) whose input has at most ``SMALL_ROWS`` rows (leading
dimensions flattened) sums its reduction in two halves and adds the partial products, bias
last, in the input's dtype. Its result differs from the 4+-row kernel's in the last bits; 4+
rows are untouched.

Where it is installed: the test process (``conftest.py``), the ranks of ``world.py`` and
``fault_ranks.py`` (forked from a server that imported torch before the switch), and any
other Python process the tests start with ``rounding_site`` on ``PYTHONPATH`` (conftest puts it
there while the switch is on; its ``sitecustomize`` installs the patch once torch is imported).
"""

from __future__ import annotations

import os
from typing import Any

ENV = "SHARDGEN_TEST_SMALL_ROWS"
SMALL_ROWS = 3  # inputs with at most this many rows take the other summation order
SITE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "rounding_site")

_original: dict[str, Any] = {}


def enabled() -> bool:
    """Whether the switch is asked for in this process's environment."""
    return os.environ.get(ENV, "") not in ("", "0")


def installed() -> bool:
    """Whether the small-row kernels are in place now (``torch.nn.functional.linear`` patched)."""
    import torch.nn.functional as F

    return getattr(F.linear, "_small_rows", False)


def _rows(x: Any) -> int:
    return 1 if x.dim() < 2 else x.numel() // max(1, x.shape[-1])


def _small_linear(input: Any, weight: Any, bias: Any = None) -> Any:
    """``F.linear`` with the reduction split in two halves when ``input`` has <= 3 rows."""
    linear = _original["linear"]
    k = input.shape[-1] if input.dim() else 0
    # Under invariant numerics the linear runs as tiles of 16 rows (shardgen.numerics.ops), each
    # a matmul call of 16 rows: the small-row kernels this switch stands for never run there.
    if weight.dim() != 2 or k < 2 or _rows(input) > SMALL_ROWS or _invariant():
        return linear(input, weight, bias)
    h = k // 2
    out = linear(input[..., :h], weight[:, :h])
    out += linear(input[..., h:], weight[:, h:])  # in place: the switch runs on most decode steps
    if bias is not None:
        out += bias
    return out


def _invariant() -> bool:
    import sys

    mode = sys.modules.get("shardgen.numerics.mode")
    return mode is not None and mode.active()


def _small_addmm(input: Any, mat1: Any, mat2: Any, *args: Any, **kwargs: Any) -> Any:
    """``torch.addmm`` likewise, for the plain call ``addmm(bias, x, w)`` (GPT-2's ``Conv1D``)."""
    addmm = _original["addmm"]
    if args or kwargs or mat1.dim() != 2 or mat1.shape[0] > SMALL_ROWS or mat1.shape[1] < 2 or _invariant():
        return addmm(input, mat1, mat2, *args, **kwargs)
    import torch

    h = mat1.shape[1] // 2
    out = torch.mm(mat1[:, :h], mat2[:h])
    out += torch.mm(mat1[:, h:], mat2[h:])
    out += input
    return out


_small_linear._small_rows = True  # type: ignore[attr-defined]
_small_addmm._small_rows = True  # type: ignore[attr-defined]


def install() -> None:
    """Put the small-row kernels in place (idempotent). Process-wide, for tests only."""
    import torch
    import torch.nn.functional as F

    if installed():
        return
    _original.setdefault("linear", F.linear)
    _original.setdefault("addmm", torch.addmm)
    F.linear = _small_linear
    torch.addmm = _small_addmm


def uninstall() -> None:
    """Restore torch's own kernels."""
    import torch
    import torch.nn.functional as F

    if installed():
        F.linear = _original["linear"]
        torch.addmm = _original["addmm"]


def apply_env() -> bool:
    """``install()`` if the switch is on in this process's environment, else ``uninstall()`` (a
    rank forked from a server that had it on follows its own environment); whether it is on."""
    if enabled():
        install()
    else:
        uninstall()
    return enabled()
