"""Paired comparisons over seeds: the mean of per-seed differences and its 95% t-interval.

Each seed's runs share the teacher, the data order, the evaluation clips and their noise, so a
kind's number minus the reference's (dense, for the adaptation study) is one paired observation
per seed. With ``n`` seeds, the interval is ``mean ± t(0.975, n-1) * sd / sqrt(n)`` (Student's t:
the differences' spread is estimated from the same few seeds). scipy may be absent, so the
quantile comes from ``T975`` for 1..30 degrees of freedom and from the Cornish-Fisher expansion
past that (within 1e-4 of the exact quantile at 31 and above).
"""

from __future__ import annotations

import math
import statistics

T975 = (12.7062, 4.3027, 3.1824, 2.7764, 2.5706, 2.4469, 2.3646, 2.3060, 2.2622, 2.2281,
        2.2010, 2.1788, 2.1604, 2.1448, 2.1314, 2.1199, 2.1098, 2.1009, 2.0930, 2.0860,
        2.0796, 2.0739, 2.0687, 2.0639, 2.0595, 2.0555, 2.0518, 2.0484, 2.0452, 2.0423)
"""Student's t 0.975 quantile for 1..30 degrees of freedom."""
Z975 = 1.959963984540054


def t975(df: int) -> float:
    """Student's t 0.975 quantile with ``df`` degrees of freedom (``df >= 1``)."""
    if df < 1:
        raise ValueError(f"df={df}: a t-interval needs at least 2 observations (df >= 1)")
    if df <= len(T975):
        return T975[df - 1]
    z = Z975
    return (z + (z ** 3 + z) / (4 * df) + (5 * z ** 5 + 16 * z ** 3 + 3 * z) / (96 * df ** 2)
            + (3 * z ** 7 + 19 * z ** 5 + 17 * z ** 3 - 15 * z) / (384 * df ** 3))


def paired_interval(values: list[float], reference: list[float]) -> dict:
    """The per-seed differences ``values[i] - reference[i]`` (pairs with a NaN left out): their
    ``mean``, ``sd``, ``n``, the 95% t-interval ``lo``/``hi`` (NaN with fewer than 2 pairs) and
    the same for the relative difference ``values / reference - 1`` (``rel_*``, in percent)."""
    if len(values) != len(reference):
        raise ValueError(f"{len(values)} values against {len(reference)} references: pair them seed by seed")
    pairs = [(v, r) for v, r in zip(values, reference) if not (math.isnan(v) or math.isnan(r))]
    out = {"n": len(pairs), "diffs": [v - r for v, r in pairs]}
    out.update(_interval([v - r for v, r in pairs]))
    rel = _interval([100 * (v / r - 1) for v, r in pairs if r != 0])
    out.update({f"rel_{k}": x for k, x in rel.items()})
    return out


def _interval(d: list[float]) -> dict:
    if not d:
        return {"mean": math.nan, "sd": math.nan, "lo": math.nan, "hi": math.nan}
    mean = statistics.fmean(d)
    if len(d) < 2:
        return {"mean": mean, "sd": math.nan, "lo": math.nan, "hi": math.nan}
    sd = statistics.stdev(d)
    half = t975(len(d) - 1) * sd / math.sqrt(len(d))
    return {"mean": mean, "sd": sd, "lo": mean - half, "hi": mean + half}


def verdict(ci: dict) -> str:
    """``"above"``, ``"below"`` or ``"overlaps 0"``: where the interval of a difference lies."""
    if math.isnan(ci["lo"]):
        return "no interval"
    return "above" if ci["lo"] > 0 else "below" if ci["hi"] < 0 else "overlaps 0"
