"""Arm spreads (fan-out values) and per-window permutations.

Pure module: plain Python floats, ``math`` and ``hashlib`` only, so every process computes
bit-identical values and no global random state (``random``, numpy, torch) is touched.

Terminology: a *slot* is one of the ``n`` evenly spaced spread values of an axis; an *arm*
``r`` uses slot ``perm_k[r]`` in window ``k``, where ``perm_k`` is drawn afresh per window and
per axis (so an arm's data shard is not tied to one multiplier, and axes are independent).
"""

from __future__ import annotations

import hashlib
import math
import struct
from collections.abc import Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover - typing only
    from hdet_megatron.config import Axis, HDETConfig

__all__ = [
    "linear_multipliers",
    "log_multipliers",
    "slot_offsets",
    "slot_values",
    "window_permutation",
    "arm_values",
    "arm_spread",
    "arm_axis_value",
]

#: Version tag of the permutation stream: bump it (never silently) if the encoding changes,
#: since resumed runs rely on drawing the same permutations as before.
_PERM_STREAM = b"hdet-perm-v1"
_TWO64 = 1 << 64


def _check_n(n: int) -> None:
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"number of arms n={n!r} must be an integer >= 1")


def _check_alpha(alpha: float) -> float:
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
        raise ValueError(f"spread alpha={alpha!r} must be a finite number")
    if alpha < 0:
        raise ValueError(f"spread alpha={alpha!r} must be >= 0")
    return float(alpha)


def _unit_positions(n: int) -> list[float]:
    """``u_r = (r - (n-1)/2) / max((n-1)/2, 0.5)``: n evenly spaced points in [-1, 1].

    ``r - (n-1)/2`` is an exact half-integer and negation commutes with rounding, so
    ``u[n-1-r] == -u[r]`` exactly (the middle one of an odd n is exactly 0).
    """
    half = max((n - 1) / 2.0, 0.5)
    return [(r - (n - 1) / 2.0) / half for r in range(n)]


def slot_offsets(n: int, alpha: float) -> list[float]:
    """Additive slot offsets ``alpha * u_r``: evenly spaced in ``[-alpha, alpha]``.

    Exactly antisymmetric (``d[n-1-r] == -d[r]``), so their sum is exactly 0.
    """
    _check_n(n)
    alpha = _check_alpha(alpha)
    return [alpha * u for u in _unit_positions(n)]


def linear_multipliers(n: int, alpha: float) -> list[float]:
    """The paper's multipliers ``rho_r = 1 + alpha * (r - (n-1)/2) / max((n-1)/2, 0.5)``.

    Evenly spaced in ``[1-alpha, 1+alpha]``; ``n == 1`` gives ``[1.0]``. The mean is exactly
    1 (``math.fsum(m) / n == 1.0``): each upper value ``1 + x`` is rounded first and its mirror
    is built from the *rounded* excess ``x' = fl(1 + x) - 1`` (exact), as ``1 - x'`` (also
    exact, since ``x'`` is a multiple of 2**-52 in [0, 1)), so every symmetric pair sums to
    exactly 2. Each value is within 2**-52 (one ulp of 1) of the exact formula.
    """
    _check_n(n)
    alpha = _check_alpha(alpha)
    if alpha >= 1 and n > 1:
        raise ValueError(
            f"linear spread alpha={alpha} >= 1 gives a multiplier <= 0; use alpha < 1 or log spread"
        )
    u = _unit_positions(n)
    out = [1.0] * n
    for r in range(n // 2):
        upper = n - 1 - r
        excess = (1.0 + alpha * u[upper]) - 1.0  # exact: Sterbenz, both in [1, 2)
        out[upper] = 1.0 + excess
        out[r] = 1.0 - excess
    return out


def log_multipliers(n: int, alpha: float) -> list[float]:
    """Log-symmetric multipliers ``exp(alpha * (r - (n-1)/2) / max((n-1)/2, 0.5))``.

    Evenly spaced in log space over ``[-alpha, alpha]`` (the exponents are exactly
    antisymmetric), geometric mean 1 up to rounding of ``exp``. Any ``alpha >= 0`` is valid.
    """
    return [math.exp(d) for d in slot_offsets(n, alpha)]


def slot_values(axis: Axis, n: int) -> list[float]:
    """The ``n`` slot values of an axis, in increasing order.

    Multiplicative axes: multipliers (``linear_multipliers`` or ``log_multipliers`` according
    to ``axis.kind``). Additive axes (``axis.additive``, e.g. dropout): offsets
    ``alpha * u_r`` around the base value (sum exactly 0).
    """
    if axis.additive:
        return slot_offsets(n, axis.spread)
    if axis.kind == "log":
        return log_multipliers(n, axis.spread)
    if axis.kind == "linear":
        return linear_multipliers(n, axis.spread)
    raise ValueError(f"Axis({axis.name!r}).kind={axis.kind!r} must be 'linear' or 'log'")


def _encode_key(seed: int, window: int, axis_name: str) -> bytes:
    # Canonical, unambiguous encoding: fixed-width integers, length-prefixed UTF-8 name.
    name = axis_name.encode("utf-8")
    return _PERM_STREAM + struct.pack(">QQQ", seed, window, len(name)) + name


def _draw_stream(seed: int, window: int, axis_name: str) -> Iterator[int]:
    """Counter-based generator: 64-bit draws ``blake2b(key || counter)``."""
    base = hashlib.blake2b(_encode_key(seed, window, axis_name), digest_size=8)
    counter = 0
    while True:
        h = base.copy()
        h.update(counter.to_bytes(8, "big"))
        counter += 1
        yield int.from_bytes(h.digest(), "big")


def window_permutation(seed: int, window: int, axis_name: str, n: int) -> list[int]:
    """A permutation of ``range(n)`` keyed by ``(seed, window, axis_name)``.

    Drawn by Fisher-Yates from a counter-based stream (blake2b of a canonical encoding of the
    key plus a counter); unbiased via rejection of the top partial block of 2**64. Identical on
    every process and after a restart, and it never reads or advances any global RNG.
    Different axes (or windows, or seeds) give independent permutations.
    """
    _check_n(n)
    for label, value in (("seed", seed), ("window", window)):
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < _TWO64:
            raise ValueError(f"{label}={value!r} must be an integer in [0, 2**64)")
    if not isinstance(axis_name, str) or not axis_name:
        raise ValueError(f"axis_name={axis_name!r} must be a non-empty string")
    perm = list(range(n))
    draws = _draw_stream(seed, window, axis_name)
    for i in range(n - 1, 0, -1):
        bound = i + 1
        limit = _TWO64 - (_TWO64 % bound)  # accept draws < limit: exactly uniform modulo
        while True:
            x = next(draws)
            if x < limit:
                break
        j = x % bound
        perm[i], perm[j] = perm[j], perm[i]
    return perm


def arm_values(axis: Axis, n: int, seed: int, window: int) -> list[float]:
    """What each arm ``r`` uses on this axis in window ``window``: ``slot_values[perm[r]]``."""
    slots = slot_values(axis, n)
    perm = window_permutation(seed, window, axis.name, n)
    return [slots[p] for p in perm]


def arm_spread(config: HDETConfig, n: int, window: int) -> dict[str, list[float]]:
    """``arm_values`` of every axis of ``config`` (seed ``config.seed``), keyed by axis name."""
    return {axis.name: arm_values(axis, n, config.seed, window) for axis in config.resolved_axes}


def arm_axis_value(axis: Axis, base: float, scale: float, spread_value: float) -> float:
    """The value an arm uses: ``base * scale * rho`` (multiplicative) or
    ``base + shift + offset`` (additive; ``scale`` is then the controller's shift), clipped to
    ``[axis.min, axis.max]`` where given."""
    if axis.additive:
        value = base + scale + spread_value
    else:
        value = base * scale * spread_value
    if axis.min is not None and value < axis.min:
        value = float(axis.min)
    if axis.max is not None and value > axis.max:
        value = float(axis.max)
    return value
