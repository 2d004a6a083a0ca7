"""Looking at runs: a static HTML viewer (``ragen view``) and training curves (``ragen plot``)."""

from ragen.viz.viewer import build_site, serve

__all__ = ["build_site", "serve", "plot_runs"]


def plot_runs(*args, **kwargs):
    """See :func:`ragen.viz.plots.plot_runs` (imported lazily: it needs matplotlib)."""
    from ragen.viz.plots import plot_runs as _plot_runs

    return _plot_runs(*args, **kwargs)
