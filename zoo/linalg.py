"""The linalg cases of the zoo: every ``torch.linalg`` function, called in a constructor, under the deferred oracle.

Each case is a module whose ``__init__`` draws random inputs and keeps what ``torch.linalg.<fn>`` returns: floating
and complex results as parameters, integer ones (pivots, ranks, infos) as buffers, named by the result's fields
(``U``, ``S``, ``Vh``). The functions are those ``torch.linalg`` exports; their arguments come from the first line of
their docstrings (``linalg.svd(A, full_matrices=True, *, ...)``: the required ones) and rules over the names: ``A``
square and well conditioned, symmetric positive definite for the Cholesky, LDL and Hermitian eigen functions, upper
triangular for ``solve_triangular``, tall for the factorizations that take any shape; ``B`` a right-hand side;
``LU``/``LD`` and ``pivots`` from the matching factorization, in the constructor too. Each function at three
variants: float32 (``svd``), with a leading batch dimension (``svd[batched]``), complex64 (``svd[complex]``).
"""

from __future__ import annotations

import functools
import re
from typing import Any, Callable

import torch
from torch import nn

from zoo.outcomes import Skipped

VARIANTS = ("", "batched", "complex")
SQUARE, TALL = (4, 4), (5, 3)
HERMITIAN = re.compile(r"cholesky|eigh|eigvalsh|ldl")
ANY_SHAPE = {"householder_product", "lstsq", "matrix_norm", "matrix_rank", "pinv", "qr", "svd", "svdvals"}


@functools.lru_cache(maxsize=None)
def functions() -> dict[str, list[str]]:
    """name -> its required arguments, for every function ``torch.linalg`` exports."""
    found = {}
    for name in sorted(dir(torch.linalg)):
        value = getattr(torch.linalg, name)
        if name.startswith("_") or isinstance(value, type) or not callable(value):
            continue
        line = (value.__doc__ or "").strip().splitlines()[0]
        match = re.search(r"\((.*)\)", line.split("->")[0])
        found[name] = [] if match is None else _required(match.group(1))
    return found


def _required(text: str) -> list[str]:
    names = []
    for part in (p.strip() for p in re.sub(r"\([^()]*\)", "", text).split(",")):  # dim=(-2, -1): one default
        if part and part != "*" and "=" not in part:
            names.append(part.split()[-1])
    return names


class Computed(nn.Module):
    """Keeps what ``torch.linalg.<fn>`` returns for random inputs, drawn here."""

    def __init__(self, fn: str, variant: str) -> None:
        super().__init__()
        arguments, keywords = _arguments(fn, variant)
        result = getattr(torch.linalg, fn)(*arguments, **keywords)
        fields = getattr(result, "_fields", None)
        results = [result] if isinstance(result, torch.Tensor) else list(result)
        for index, value in enumerate(results):
            name = fields[index] if fields else ("out" if len(results) == 1 else f"out{index}")
            if value.is_floating_point() or value.is_complex():
                self.register_parameter(name, nn.Parameter(value, requires_grad=False))
            else:
                self.register_buffer(name, value)


def _matrix(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(*shape, dtype=dtype)


def _square(batch: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return _matrix((*batch, *SQUARE), dtype) + 4 * torch.eye(SQUARE[0], dtype=dtype)


def _hermitian(batch: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    x = _matrix((*batch, *SQUARE), dtype)
    return x @ x.mH + SQUARE[0] * torch.eye(SQUARE[0], dtype=dtype)


def _arguments(fn: str, variant: str) -> tuple[list[Any], dict[str, Any]]:
    dtype = torch.complex64 if variant == "complex" else torch.float32
    batch = (2,) if variant == "batched" else ()
    m = lambda *shape: _matrix((*batch, *shape), dtype)  # noqa: E731
    if fn == "tensorinv":
        return [m(2, 4, 8)], {}
    if fn == "tensorsolve":
        return [m(2, 3, 6), m(2, 3)], {}
    if fn == "multi_dot":
        return [[m(3, 4), m(4, 5), m(5, 2)]], {}
    if HERMITIAN.search(fn):
        a = _hermitian(batch, dtype)
    elif fn == "solve_triangular":
        a = _square(batch, dtype).triu()
    elif fn in ANY_SHAPE:
        a = m(*TALL)
    else:
        a = _square(batch, dtype)
    rules: dict[str, Callable[[], Any]] = {
        "A": lambda: a,
        "B": lambda: m(a.shape[-2], 2),
        "input": lambda: m(4, 3) if fn == "cross" else m(4, 5),
        "other": lambda: m(4, 3) if fn == "cross" else m(5, 3),
        "x": lambda: m(4) if fn == "vander" else m(4, 5),
        "y": lambda: m(4, 5),
        "tau": lambda: m(2),
        "n": lambda: 3,
    }
    if fn == "lu_solve":
        rules.update(LU=lambda: factored[0], pivots=lambda: factored[1])
        factored = torch.linalg.lu_factor(a)
    if fn == "ldl_solve":
        rules.update(LD=lambda: factored[0], pivots=lambda: factored[1])
        factored = torch.linalg.ldl_factor(a)
    required = functions()[fn]
    keywords = {"upper": True} if "upper" in required else {}
    return [rules[name]() for name in required if name != "upper"], keywords


def case_models() -> list[tuple[str, str]]:
    return [("deferred", fn + (f"[{variant}]" if variant else "")) for fn in functions() for variant in VARIANTS]


RULES = frozenset({"A", "B", "input", "other", "x", "y", "tau", "n", "LU", "LD", "pivots", "tensors", "upper"})


def builder(model: str) -> Callable[[], nn.Module]:
    fn, _, variant = model.partition("[")
    if fn not in functions():
        raise Skipped(f"torch.linalg has no {fn} here")
    missing = [name for name in functions()[fn] if name not in RULES]
    if missing:
        raise Skipped(f"no rule gives linalg.{fn}'s argument {missing[0]!r}")
    return lambda: Computed(fn, variant.rstrip("]"))


def run_case(oracle: str, model: str, folder) -> list[str]:
    from zoo import deferred

    return deferred.check(builder(model), folder)
