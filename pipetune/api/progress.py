"""What :func:`pipetune.tune` draws while its study runs: a progress bar in a notebook
(``tqdm``'s: a widget where ``ipywidgets`` is installed, a line of text otherwise), the
command line's live table in a terminal, nothing elsewhere (a script's output into a
file keeps only what it prints)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any


def in_notebook() -> bool:
    """Whether this runs in a Jupyter kernel (IPython's own terminal is not one)."""
    shell = sys.modules.get("IPython")
    get = getattr(shell, "get_ipython", None)
    kernel = get() if get is not None else None
    return kernel is not None and "IPKernelApp" in getattr(kernel, "config", {})


def display_for(progress: bool | None) -> Callable[[int, str], Any]:
    """``(trials, metric) -> context`` for :func:`pipetune.cli.tune.tune_study`:
    ``progress`` True or False, or None (draw where there is somewhere to draw)."""
    notebook = in_notebook()
    if progress is None:
        progress = notebook or sys.stderr.isatty()
    if not progress:
        return NoDisplay
    if notebook:
        return TrialsBar
    from pipetune.cli.tune_display import LiveDisplay

    return LiveDisplay


def quiet_tqdm_advice() -> None:
    """In a notebook without ``ipywidgets``, importing ``tqdm.auto`` (Optuna does, for
    its own bars) warns "IProgress not found. Please update jupyter and ipywidgets":
    imported here first, without that warning, as pipetune draws its bar as text there."""
    if not in_notebook():
        return
    import warnings

    from tqdm import TqdmWarning

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", TqdmWarning)
        import tqdm.auto  # noqa: F401


class NoDisplay:
    """Draws nothing."""

    def __init__(self, trials: int, metric: str) -> None:
        pass

    def __enter__(self) -> NoDisplay:
        return self

    def __exit__(self, *exc: Any) -> None:
        return None

    def observe(self, event: Any) -> None:
        return None


class TrialsBar(NoDisplay):
    """A bar of trials ended out of the study's trials, the best so far beside it."""

    def __init__(self, trials: int, metric: str) -> None:
        self.trials, self.metric = trials, metric
        self._bar: Any = None
        self._best: float | None = None

    def __enter__(self) -> TrialsBar:
        try:  # a notebook's widget where Jupyter's widgets are installed
            import ipywidgets  # noqa: F401
            from tqdm.notebook import tqdm
        except ImportError:  # else a line of text (tqdm.auto would warn of it first)
            from tqdm.std import tqdm

        self._bar = tqdm(total=self.trials, unit="trial", desc="pipetune", leave=True)
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._bar is not None:
            self._bar.close()

    def observe(self, event: Any) -> None:
        from pipetune.engine.events import Stepped, TrialEnded

        if self._bar is None:
            return
        if isinstance(event, TrialEnded):
            self._bar.update(1)
        elif isinstance(event, Stepped):
            best = event.view.best()
            if best is not None and best.value is not None and best.value != self._best:
                self._best = best.value
                self._bar.set_postfix({self.metric: f"{best.value:.4g}",
                                       "trial": best.trial_id})
