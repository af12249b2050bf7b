"""Matplotlib for files: the one place the plots of reports and studies get pyplot from."""

from __future__ import annotations


def pyplot():
    """``matplotlib.pyplot`` on the Agg backend (files only, no display)."""
    try:
        import matplotlib
    except ImportError:
        raise RuntimeError("the report needs matplotlib: pip install matplotlib "
                           "(or pip install -e \".[test]\")") from None
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt
