"""Hit-rate curves as PNGs (``bench``, ``profile``), with matplotlib if it is installed
(``pip install 'tierstore[plot]'``)."""

from __future__ import annotations

from pathlib import Path


def plot_hit_rates(
    path: Path, sizes: list[float], curves: list[tuple], xlabel: str, title: str, log_x: bool = False
) -> bool:
    """Draw ``curves`` (``(label, hit rates in [0, 1], dashed)``) against ``sizes`` into ``path``;
    False when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    figure, axes = plt.subplots(figsize=(6, 4))
    for label, rates, dashed in curves:
        axes.plot(
            sizes,
            [100 * rate for rate in rates],
            marker="." if dashed else "o",
            linestyle="--" if dashed else "-",
            label=label,
        )
    if log_x:
        axes.set_xscale("log")
    axes.set_xlabel(xlabel)
    axes.set_ylabel("hit rate (% of lookups)")
    axes.set_title(title)
    axes.grid(alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return True
