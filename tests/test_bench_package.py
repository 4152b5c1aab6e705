"""The harness is its own package: the runtime never imports it, except ``gezel-trio
bench``."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

import gezel_trio
from gezel_trio.cli.main import main

RUNTIME = Path(gezel_trio.__file__).resolve().parent


def _imports_of_harness(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    found: list[ast.Import | ast.ImportFrom] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names = [node.module or ""]
        else:
            continue
        if any(n == "gezel_bench" or n.startswith("gezel_bench.") for n in names):
            found.append(node)
    return found


def test_the_runtime_imports_the_harness_only_for_its_subcommand() -> None:
    where: dict[str, int] = {}
    for path in RUNTIME.rglob("*.py"):
        found = _imports_of_harness(ast.parse(path.read_text(encoding="utf-8")))
        if found:
            where[str(path.relative_to(RUNTIME))] = len(found)
    assert where == {"cli/main.py": 1}
    # ... and there inside a function, not at module level
    tree = ast.parse((RUNTIME / "cli" / "main.py").read_text(encoding="utf-8"))
    top_level = [n for n in tree.body if isinstance(n, ast.Import | ast.ImportFrom)]
    assert not [n for n in top_level if _imports_of_harness(n)]
    assert not (RUNTIME / "bench").exists()


def test_the_runtime_serves_without_the_harness(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Without gezel_bench the command line still works; it just has no ``bench``."""
    monkeypatch.setitem(sys.modules, "gezel_bench", None)
    monkeypatch.setitem(sys.modules, "gezel_bench.cli", None)
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "--trace", "x"])
    assert exit_.value.code == 2
    assert "invalid choice: 'bench'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        main(["serve", "--help"])
    assert exit_.value.code == 0


def test_bench_help_with_the_harness(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "--help"])
    assert exit_.value.code == 0
    assert "--trace" in capsys.readouterr().out
