"""PromQL builders shared by the dashboards (strings in, strings out).

Windows use Grafana's ``$__rate_interval`` (at least four scrape intervals), so a panel
works at any scrape interval; ``sum by (...)`` keeps only the labels a panel shows.
"""

from __future__ import annotations

from collections.abc import Sequence

RATE_WINDOW = "$__rate_interval"


def _by(labels: Sequence[str]) -> str:
    return f"sum by ({', '.join(labels)}) " if labels else "sum "


def rate(metric: str, selector: str, by: Sequence[str] = ()) -> str:
    """Per-second increase of a counter, summed by ``by``."""
    return f"{_by(by)}(rate({metric}{{{selector}}}[{RATE_WINDOW}]))"


def gauge(metric: str, selector: str, by: Sequence[str] = ()) -> str:
    return f"{_by(by)}({metric}{{{selector}}})"


def quantile(q: float, histogram: str, selector: str, by: Sequence[str] = ()) -> str:
    """The ``q`` quantile of a histogram over the window (``histogram`` without ``_bucket``)."""
    return f"histogram_quantile({q}, {_by(['le', *by])}(rate({histogram}_bucket{{{selector}}}[{RATE_WINDOW}])))"


def ratio(numerator: str, denominator: str) -> str:
    """A rate ratio (hits / queries); NaN, hence a gap, while the denominator is 0."""
    return f"{numerator} / {denominator}"
