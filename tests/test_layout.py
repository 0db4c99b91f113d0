"""The package layout of DESIGN §2 and ``cluster/__init__``: import directions and no circles.

Every ``import`` / ``from ... import`` in the five packages counts, lazy ones inside
functions and ones under ``if TYPE_CHECKING:`` included (a lazy or annotation-only import
still makes two modules one idea); only a submodule's import of its own package's
``__init__`` does not. Parsed from the source, nothing is imported.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("configs", "kernels", "workers", "cluster", "tools")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The longest known module that ``name`` is or lies in (``a.b.c`` -> ``a.b`` if only that)."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def _imports(path: Path, modules: dict[str, Path]) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{a.name}" for a in node.names] + [node.module]
        else:
            continue
        found.update(m for m in (_resolve(n, modules) for n in names) if m is not None)
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    graph = {}
    for name, path in modules.items():
        # a package's own __init__ is imported by every submodule: not an edge worth a cycle
        graph[name] = {m for m in _imports(path, modules) if m != name and not name.startswith(m + ".")}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            nxt = next(edges, None)
            if nxt is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    comp = []
                    while True:
                        top = stack.pop()
                        on_stack.discard(top)
                        comp.append(top)
                        if top == node:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
            elif nxt not in index:
                index[nxt] = low[nxt] = len(index)
                stack.append(nxt)
                on_stack.add(nxt)
                work.append((nxt, iter(sorted(graph[nxt]))))
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
    return out


def test_no_import_circles():
    assert _cycles(_graph()) == []


def test_cycle_finder_finds_a_circle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


# DESIGN §2, and cluster/__init__ for the subpackages: who may not import whom
FORBIDDEN = {
    "configs": ("kernels", "workers", "cluster", "tools"),
    "kernels": ("workers", "cluster", "tools"),
    "workers": ("cluster", "tools"),
    "tools": ("cluster",),
    "cluster.observability": ("cluster.api", "cluster.serving", "cluster.bench", "cluster.app"),
    "cluster.routing": ("cluster.api", "cluster.serving", "cluster.observability", "cluster.bench", "cluster.app"),
    "cluster.serving": ("cluster.api", "cluster.bench", "cluster.app", "cluster.cli"),
    "cluster.api": ("cluster.bench", "cluster.app", "cluster.cli"),
    "cluster.store": (
        "cluster.api",
        "cluster.serving",
        "cluster.routing",
        "cluster.observability",
        "cluster.actors",
        "cluster.bench",
        "cluster.app",
    ),
    "cluster.actors": ("cluster.api", "cluster.serving", "cluster.bench", "cluster.app", "cluster.cli"),
}


def _in(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def test_import_directions():
    bad = [
        f"{src} imports {dst}"
        for src, dsts in sorted(_graph().items())
        for dst in sorted(dsts)
        for pkg, banned in FORBIDDEN.items()
        if _in(src, pkg) and any(_in(dst, b) for b in banned)
    ]
    assert bad == []


# -- the product apart from the lab (DESIGN §2): cluster/bench is what ``hybridserve bench``
# runs (the client, the suite and what the suite imports) and tools a user points at a
# server; a harness of a finished investigation lives in tests/lab, never in a product package
BENCH_ENTRIES = ("cluster.cli", "cluster.bench.http_latency")  # http_latency: ``--url URL``


def _reachable(graph: dict[str, set[str]], starts: tuple[str, ...]) -> set[str]:
    seen, todo = set(starts), list(starts)
    while todo:
        for dst in graph[todo.pop()] - seen:
            seen.add(dst)
            todo.append(dst)
    return seen


def test_bench_holds_only_what_the_cli_runs():
    graph = _graph()
    bench = {m for m in graph if _in(m, "cluster.bench") and m != "cluster.bench"}
    assert sorted(bench - _reachable(graph, BENCH_ENTRIES)) == []


def test_only_the_cli_imports_bench():
    bad = [
        f"{src} imports {dst}"
        for src, dsts in sorted(_graph().items())
        for dst in sorted(dsts)
        if _in(dst, "cluster.bench") and not (_in(src, "cluster.bench") or src == "cluster.cli")
    ]
    assert bad == []


def _top_level_imports(path: Path) -> set[str]:
    """The first name of every absolute import of a module (lazy and annotation-only included)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name.partition(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module.partition(".")[0])
    return found


def test_only_the_bench_imports_the_tiny_factory():
    """tools/ makes checkpoints; serving never runs it. The bench builds its random models with
    ``tools.tiny*``; the training tools are imported by nothing outside ``tools``."""
    bad = [
        f"{src} imports {dst}"
        for src, dsts in sorted(_graph().items())
        for dst in sorted(dsts)
        if _in(dst, "tools")
        and not _in(src, "tools")
        and not (_in(src, "cluster.bench") and dst.startswith("tools.tiny"))
    ]
    assert bad == []


def test_product_imports_no_tests():
    bad = [
        str(path.relative_to(ROOT))
        for pkg in PACKAGES
        for path in sorted((ROOT / pkg).rglob("*.py"))
        if "tests" in _top_level_imports(path)
    ]
    assert bad == []


def test_reachability_finds_a_stray_harness():
    graph = {
        "cluster.cli": {"cluster.bench.command"},
        "cluster.bench.command": {"cluster.bench.suite"},
        "cluster.bench.suite": set(),
        "cluster.bench.probe": {"cluster.bench.suite"},
    }
    assert _reachable(graph, ("cluster.cli",)) == {"cluster.cli", "cluster.bench.command", "cluster.bench.suite"}


# -- DESIGN.md: every "DESIGN §n" (and "DESIGN §n rule m") in the code names a heading of it
DESIGN = ROOT / "DESIGN.md"
CITATION = re.compile(r"DESIGN §(\d+(?:\.\d+)*)(?:\s+rule\s+(\d+))?")
HEADING = re.compile(r"^(#{2,6})\s+(\d+(?:\.\d+)*)\.?\s")


def _sections(text: str) -> dict[str, str]:
    """Numbered heading -> its text, subsections included (up to the next heading of the
    same or a higher level)."""
    lines = text.splitlines()
    heads = [(i, len(m.group(1)), m.group(2)) for i, line in enumerate(lines) if (m := HEADING.match(line))]
    out = {}
    for k, (i, level, number) in enumerate(heads):
        end = next((j for j, lvl, _ in heads[k + 1 :] if lvl <= level), len(lines))
        out[number] = "\n".join(lines[i:end])
    return out


def _unresolved(citations: list[tuple[str, str, str]], sections: dict[str, str]) -> list[str]:
    """``(where, section, rule)`` citations that name no heading (or no rule in it)."""
    bad = []
    for where, number, rule in citations:
        if number not in sections:
            bad.append(f"{where}: DESIGN §{number} has no heading")
        elif rule and f"**Rule {rule} " not in sections[number]:
            bad.append(f"{where}: DESIGN §{number} has no rule {rule}")
    return bad


def _code_citations() -> list[tuple[str, str, str]]:
    found = []
    for pkg in PACKAGES + ("tests",):
        for path in sorted((ROOT / pkg).rglob("*.py")):
            for n, line in enumerate(path.read_text().splitlines(), 1):
                found += [
                    (f"{path.relative_to(ROOT)}:{n}", m.group(1), m.group(2) or "") for m in CITATION.finditer(line)
                ]
    return found


def test_design_citations_resolve():
    citations = _code_citations()
    assert citations, "no DESIGN § citation found: is the pattern still right?"
    sections = _sections(DESIGN.read_text())
    assert _unresolved(citations, sections) == []


def test_design_cross_references_resolve():
    text = DESIGN.read_text()
    sections = _sections(text)
    refs = {m.group(1) for m in re.finditer(r"§(\d+(?:\.\d+)*)", text)}
    assert sorted(r for r in refs if r not in sections) == []


def test_citation_checker_finds_a_dangling_citation():
    sections = _sections("# t\n## 1. One\n### 1.1 Sub\n- **Rule 2 (x).** y\n## 2. Two\n")
    assert set(sections) == {"1", "1.1", "2"}
    assert _unresolved([("a", "1", "2"), ("b", "1.1", ""), ("c", "2", "")], sections) == []
    assert _unresolved([("a", "3", ""), ("b", "2", "2"), ("c", "1.2", "")], sections) == [
        "a: DESIGN §3 has no heading",
        "b: DESIGN §2 has no rule 2",
        "c: DESIGN §1.2 has no heading",
    ]


# -- product code names no tracker items: a comment or docstring keeps its one-line why
ISSUE_REF = re.compile(r"\bissues?\s*#?\d+", re.IGNORECASE)
NOT_PRODUCT = ("cluster/bench/",)  # the benchmark client and suite; tests/ is not scanned
# Still being cleaned by their owners (a path leaves this list once it is clean):
STILL_DIRTY: tuple[str, ...] = ()


def _prose(source: str) -> list[tuple[int, str]]:
    """(line, text) of every comment and every string statement (docstrings) of a module."""
    out = [
        (tok.start[0], tok.string)
        for tok in tokenize.generate_tokens(io.StringIO(source).readline)
        if tok.type == tokenize.COMMENT
    ]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            out += [(node.lineno + i, line) for i, line in enumerate(node.value.value.splitlines())]
    return sorted(out)


def _issue_refs(rel: str, source: str) -> list[str]:
    return [f"{rel}:{n}: {text.strip()}" for n, text in _prose(source) if ISSUE_REF.search(text)]


def test_no_tracker_numbers_in_product_code():
    found = []
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if not rel.startswith(NOT_PRODUCT + STILL_DIRTY):
                found += _issue_refs(rel, path.read_text())
    assert found == []


def test_tracker_number_finder_reads_comments_and_docstrings():
    source = (
        '"""Compiled steps (issue 16)."""\n'
        'def f():\n    """See Issue #7."""\n    return "issue 3"  # from issues 41-42\n'
    )
    assert [ref.split(":")[1] for ref in _issue_refs("m.py", source)] == ["1", "3", "4"]
