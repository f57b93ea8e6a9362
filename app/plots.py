"""Proof plots rendered on the server with matplotlib to PNG bytes, once each.

A stored proof never changes, so each plot is drawn on first request and kept in the app's
`PlotCache` (in memory, least recently used dropped first). Figures are built with
`matplotlib.figure.Figure` and its Agg canvas, not pyplot, so no global figure state is shared
between the server's threads.
"""

from __future__ import annotations

import io
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable

from flask import Flask, current_app
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from models.runs import Proof, ProofCase

PASS, FAIL, SPEC, PLAIN, INK = "#2f9e6b", "#d64545", "#3b6fd8", "#9aa5b8", "#2b3445"
CACHED_PLOTS = 256  # about 40 KiB each


class PlotCache:
    """PNG bytes by key, the least recently used dropped past `size` entries; thread-safe."""

    def __init__(self, size: int = CACHED_PLOTS) -> None:
        self.size = size
        self._items: OrderedDict[Hashable, bytes] = OrderedDict()
        self._lock = threading.Lock()
        self.renders = 0  # how many plots were drawn, for tests and curiosity

    def get(self, key: Hashable, render: Callable[[], bytes]) -> bytes:
        """The PNG for `key`, drawn by `render` the first time."""
        with self._lock:
            if key in self._items:
                self._items.move_to_end(key)
                return self._items[key]
            # Drawing under the lock: matplotlib's text and font caches are not thread-safe.
            data = render()
            self.renders += 1
            self._items[key] = data
            while len(self._items) > self.size:
                self._items.popitem(last=False)
            return data

    def peek(self, key: Hashable) -> bytes | None:
        """The PNG for `key` if it was drawn already, else None."""
        with self._lock:
            return self._items.get(key)


def init_app(app: Flask) -> None:
    """Give the app its plot cache."""
    app.extensions["specpipe.plots"] = PlotCache()


def plot_cache() -> PlotCache:
    """The current app's plot cache."""
    return current_app.extensions["specpipe.plots"]


def _subplots(figsize: tuple[float, float], **kwargs):
    fig = Figure(figsize=figsize)
    FigureCanvasAgg(fig)
    return fig, fig.subplots(**kwargs)


def _png(fig: Figure) -> bytes:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110, bbox_inches="tight")
    return buffer.getvalue()


def _style(ax) -> None:
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    ax.tick_params(colors=INK, labelsize=8)
    ax.grid(axis="y", color="#e6e9ef", linewidth=0.8)
    ax.set_axisbelow(True)


def tv_plot(proof: Proof) -> bytes:
    """TV distance per case as bars, coloured by pass/fail, with the gate and noise floor."""
    cases = proof.cases
    fig, ax = _subplots((max(5.0, 0.5 * len(cases) + 2), 3.2))
    _style(ax)
    xs = range(len(cases))
    ax.bar(xs, [c.tv for c in cases], color=[PASS if c.passed else FAIL for c in cases])
    if proof.gate is not None:
        ax.axhline(proof.gate, color=FAIL, linestyle="--", linewidth=1.2, label="gate")
    noise = [c.noise_tv for c in cases]
    if any(n is not None for n in noise):
        ax.plot(
            xs,
            [n if n is not None else float("nan") for n in noise],
            "o",
            color=INK,
            markersize=4,
            label="noise floor (plain vs plain)",
        )
    ax.set_xticks(list(xs), [c.label for c in cases], rotation=45, ha="right", fontsize=7)
    ax.set_ylabel("total variation distance", color=INK, fontsize=9)
    ax.set_title(f"TV per case — {proof.kind.replace('_', ' ')}", color=INK, fontsize=10)
    if proof.gate is not None or any(n is not None for n in noise):
        ax.legend(frameon=False, fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return _png(fig)


def histogram_plot(case: ProofCase, top: int = 20) -> bytes:
    """Spec vs plain token frequencies at one stop, with the TV against the noise floor."""
    spec = {str(k): v for k, v in (case.spec_counts or {}).items()}
    plain = {str(k): v for k, v in (case.plain_counts or {}).items()}
    tokens = sorted(set(spec) | set(plain), key=lambda t: -(spec.get(t, 0) + plain.get(t, 0)))
    tokens = tokens[:top]
    spec_total = sum(spec.values()) or 1
    plain_total = sum(plain.values()) or 1
    fig, (hist, bars) = _subplots((8.5, 3.2), ncols=2, gridspec_kw={"width_ratios": [4, 1.2]})
    _style(hist)
    xs = range(len(tokens))
    width = 0.4
    hist.bar(
        [x - width / 2 for x in xs],
        [spec.get(t, 0) / spec_total for t in tokens],
        width,
        color=SPEC,
        label="speculative",
    )
    hist.bar(
        [x + width / 2 for x in xs],
        [plain.get(t, 0) / plain_total for t in tokens],
        width,
        color=PLAIN,
        label="plain",
    )
    hist.set_xticks(list(xs), tokens, rotation=60, ha="right", fontsize=7)
    hist.set_ylabel("frequency", color=INK, fontsize=9)
    hist.set_xlabel("token id (most frequent first)", color=INK, fontsize=8)
    hist.set_title(f"{case.label}", color=INK, fontsize=10)
    hist.legend(frameon=False, fontsize=8)

    _style(bars)
    labels, values, colors = ["spec vs\nplain"], [case.tv], [PASS if case.passed else FAIL]
    if case.noise_tv is not None:
        labels.append("noise\nfloor")
        values.append(case.noise_tv)
        colors.append(PLAIN)
    bars.bar(labels, values, color=colors)
    if case.proof.gate is not None:
        bars.axhline(case.proof.gate, color=FAIL, linestyle="--", linewidth=1.2)
        bars.annotate(
            "gate",
            (1.0, case.proof.gate),
            xycoords=("axes fraction", "data"),
            xytext=(2, 0),
            textcoords="offset points",
            color=FAIL,
            fontsize=7,
            va="center",
        )
    bars.set_title("TV", color=INK, fontsize=10)
    return _png(fig)
