"""A small Grafana dashboard model: rows of panels of PromQL targets, rendered to JSON.

Dashboards are data (frozen dataclasses), so tests can walk every expression: check the
metric names it references, substitute the template variables and ask a real Prometheus.
``Dashboard.to_grafana()`` is the only place that knows Grafana's JSON shape (schema 39,
Grafana 10/11). Layout is computed: rows are full-width, panels flow left to right in
each row by ``width`` (24 columns), ``HEIGHT`` units high. Panel ids follow the order of
the panels, so they are stable as long as the panel list is.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

HEIGHT = 8
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
_METRIC = re.compile(r"\b(?:hybridserve|ray)_[A-Za-z0-9_:]+")
_QUOTED = re.compile(r'"(?:[^"\\]|\\.)*"')
_VARIABLE = re.compile(r"\$(?:\{(\w+)\}|(\w+))")


@dataclass(frozen=True)
class Target:
    expr: str
    legend: str = ""


@dataclass(frozen=True)
class Panel:
    title: str
    description: str
    targets: tuple[Target, ...]
    unit: str = "short"
    kind: str = "timeseries"  # timeseries | stat
    max: float | None = None
    alarm_at: float | None = None  # red at or above this value (a threshold line)
    width: int = 12

    def __post_init__(self) -> None:
        if self.kind not in ("timeseries", "stat"):
            raise ValueError(f"panel {self.title!r}: kind must be timeseries or stat, got {self.kind!r}")
        if not self.targets:
            raise ValueError(f"panel {self.title!r} has no targets")


@dataclass(frozen=True)
class Row:
    title: str
    panels: tuple[Panel, ...]


@dataclass(frozen=True)
class Variable:
    """A multi-value Prometheus label variable; "All" means the regex ``.*``."""

    name: str
    label: str
    query: str  # label_values(metric{...}, label)

    def to_grafana(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "label": self.label,
            "type": "query",
            "datasource": DATASOURCE,
            "definition": self.query,
            "query": {"query": self.query, "refId": "PrometheusVariableQueryEditor-VariableQuery"},
            "refresh": 2,
            "includeAll": True,
            "multi": True,
            "allValue": ".*",
            "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
            "sort": 1,
            "hide": 0,
            "options": [],
            "regex": "",
            "skipUrlSync": False,
        }


@dataclass(frozen=True)
class Dashboard:
    uid: str
    title: str
    description: str
    rows: tuple[Row, ...]
    variables: tuple[Variable, ...]
    tags: tuple[str, ...] = ("hybridserve",)
    refresh: str = "10s"
    time_from: str = "now-30m"

    def panels(self) -> Iterator[Panel]:
        for row in self.rows:
            yield from row.panels

    def targets(self) -> Iterator[tuple[Panel, Target]]:
        for panel in self.panels():
            for target in panel.targets:
                yield panel, target

    def metric_names(self) -> set[str]:
        return {name for _, t in self.targets() for name in metric_names(t.expr)}

    def to_grafana(self) -> dict[str, Any]:
        return {
            "uid": self.uid,
            "title": self.title,
            "description": self.description,
            "tags": list(self.tags),
            "editable": True,
            "graphTooltip": 1,
            "timezone": "",
            "schemaVersion": 39,
            "version": 1,
            "refresh": self.refresh,
            "time": {"from": self.time_from, "to": "now"},
            "timepicker": {},
            "annotations": {"list": []},
            "links": [],
            "fiscalYearStartMonth": 0,
            "liveNow": False,
            "weekStart": "",
            "templating": {"list": [_datasource_variable()] + [v.to_grafana() for v in self.variables]},
            "panels": _layout(self.rows),
        }


def metric_names(expr: str) -> set[str]:
    """The hybridserve_* / ray_* metric names an expression reads (label values ignored)."""
    return set(_METRIC.findall(_QUOTED.sub('""', expr)))


def variables_in(expr: str) -> set[str]:
    return {a or b for a, b in _VARIABLE.findall(expr)}


def substitute(expr: str, values: Mapping[str, str]) -> str:
    """Replace ``$name`` / ``${name}`` as Grafana would; unknown names raise KeyError."""
    return _VARIABLE.sub(lambda m: values[m.group(1) or m.group(2)], expr)


def _datasource_variable() -> dict[str, Any]:
    return {
        "name": "datasource",
        "label": "Data source",
        "type": "datasource",
        "query": "prometheus",
        "current": {},
        "hide": 0,
        "includeAll": False,
        "multi": False,
        "options": [],
        "refresh": 1,
        "regex": "",
        "skipUrlSync": False,
    }


def _layout(rows: tuple[Row, ...]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    y, next_id = 0, 1
    for row in rows:
        out.append(
            {
                "id": next_id,
                "type": "row",
                "title": row.title,
                "collapsed": False,
                "gridPos": {"h": 1, "w": 24, "x": 0, "y": y},
                "panels": [],
            }
        )
        next_id, y, x = next_id + 1, y + 1, 0
        for panel in row.panels:
            if x + panel.width > 24:
                x, y = 0, y + HEIGHT
            out.append(_panel(panel, next_id, {"h": HEIGHT, "w": panel.width, "x": x, "y": y}))
            next_id, x = next_id + 1, x + panel.width
        y += HEIGHT
    return out


def _panel(panel: Panel, panel_id: int, grid: dict[str, int]) -> dict[str, Any]:
    steps: list[dict[str, Any]] = [{"color": "green", "value": None}]
    if panel.alarm_at is not None:
        steps.append({"color": "red", "value": panel.alarm_at})
    defaults: dict[str, Any] = {"unit": panel.unit, "min": 0, "thresholds": {"mode": "absolute", "steps": steps}}
    if panel.max is not None:
        defaults["max"] = panel.max
    if panel.kind == "timeseries":
        defaults["custom"] = {
            "drawStyle": "line",
            "lineWidth": 1,
            "fillOpacity": 10,
            "showPoints": "never",
            "spanNulls": False,
            "thresholdsStyle": {"mode": "line" if panel.alarm_at is not None else "off"},
        }
        defaults["color"] = {"mode": "palette-classic"}
        options: dict[str, Any] = {
            "legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
            "tooltip": {"mode": "multi", "sort": "desc"},
        }
    else:
        defaults["color"] = {"mode": "thresholds"}
        options = {
            "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
            "colorMode": "background",
            "graphMode": "none",
            "justifyMode": "auto",
            "orientation": "auto",
            "textMode": "auto",
        }
    return {
        "id": panel_id,
        "type": panel.kind,
        "title": panel.title,
        "description": panel.description,
        "datasource": DATASOURCE,
        "gridPos": grid,
        "fieldConfig": {"defaults": defaults, "overrides": []},
        "options": options,
        "targets": [
            {
                "refId": chr(ord("A") + i),
                "datasource": DATASOURCE,
                "expr": t.expr,
                "legendFormat": t.legend,
                "range": True,
                "instant": False,
                "editorMode": "code",
            }
            for i, t in enumerate(panel.targets)
        ],
    }
