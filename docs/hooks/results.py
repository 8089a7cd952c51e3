"""mkdocs hook: the results page must match the benchmark baselines, and the sweep's plot is
served from benchmarks/results (the one copy of it) rather than from a second file in docs/."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File, Files

_REPO = Path(__file__).resolve().parents[2]


def _report() -> Any:
    spec = importlib.util.spec_from_file_location("report", _REPO / "benchmarks" / "report.py")
    assert spec is not None and spec.loader is not None  # a file path always has a loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def on_files(files: Files, config: Any) -> Files:
    report = _report()
    page = Path(config["docs_dir"]) / "results.md"
    if not page.exists() or page.read_text() != report.docs_page():
        raise PluginError("docs/results.md is not the page the benchmark baselines give: run "
                          "python benchmarks/report.py --docs docs/results.md")
    plot = report.RESULTS / report.PLOT
    files.append(File.generated(config, f"assets/{report.PLOT}", abs_src_path=str(plot)))
    return files
