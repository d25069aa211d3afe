"""The stored results a claim can find: every `benchmarks/results/...` path and every link to the results
index named in README.md and docs/*.md exists, INDEX.md and docs/benchmarks.md are what `weightstream
bench --report benchmarks/results --index benchmarks/results/INDEX.md` writes from the stored files,
and the folders follow the naming rule. Fast, CPU only, no network."""

from __future__ import annotations

import glob
import itertools
import os
import re

import pytest

from weightstream.bench import cli
from weightstream.bench.index import FOLDER_RE, folder_errors, index_text

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
RESULTS = os.path.join(ROOT, "benchmarks", "results")
INDEX = os.path.join(RESULTS, "INDEX.md")

PAGES = ["README.md",  # the user-facing pages
         *sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))]

PATH_RE = re.compile(r"benchmarks/results/(?:\{[^{}\s]*\}|[^\s`'\"()\[\]<>,;|{}])+")
LINK_RE = re.compile(r"\]\(([^)\s]+)\)")
HISTORY_RE = re.compile(r"session ?\d|issue ?\d|_session\d|sessions \d", re.IGNORECASE)


def _read(rel: str) -> str:
    with open(os.path.join(ROOT, rel)) as f:
        return f.read()


def _expand(path: str) -> list[str]:
    """A path as the docs write it, expanded: `a_{x,y}.json` is two paths."""
    match = re.search(r"\{([^{}]*)\}", path)
    if not match:
        return [path]
    head, tail = path[:match.start()], path[match.end():]
    return [q for alt in match.group(1).split(",") for q in _expand(head + alt + tail)]


def _anchors(text: str) -> set[str]:
    """The anchors of a markdown page: explicit `<a id>` and GitHub's heading slugs."""
    ids = set(re.findall(r'<a id="([^"]+)"', text))
    for heading in re.findall(r"^#+ (.+)$", text, re.MULTILINE):
        heading = re.sub(r"<[^>]+>", "", heading)
        ids.add(re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-"))
    return ids


@pytest.mark.parametrize("page", PAGES)
def test_every_results_path_a_page_names_exists(page):
    text = _read(page)
    named = itertools.chain.from_iterable(_expand(m.rstrip(".:")) for m in PATH_RE.findall(text))
    missing = [p for p in named
               if not glob.glob(os.path.join(ROOT, p.split("#")[0]))]
    assert not missing, f"{page} names results that are not stored: {missing}"


FOLDER_READMES = sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(RESULTS, "*", "README.md")))


@pytest.mark.parametrize("page", PAGES + FOLDER_READMES)
def test_every_link_of_a_page_reaches_its_file_and_anchor(page):
    """Relative links (a results file, a row of INDEX.md, another page's section) land somewhere."""
    text = _read(page)
    here = os.path.dirname(os.path.join(ROOT, page))
    broken = []
    for link in LINK_RE.findall(text):
        if re.match(r"[a-z]+:", link):
            continue  # http(s), mailto
        target, _, anchor = link.partition("#")
        path = os.path.normpath(os.path.join(here, target)) if target else os.path.join(ROOT, page)
        if not os.path.exists(path):
            broken.append(link)
        elif anchor and path.endswith(".md"):
            with open(path) as f:
                if anchor not in _anchors(f.read()):
                    broken.append(link)
    assert not broken, f"{page}: broken links {broken}"


def test_every_figure_of_the_readme_links_to_its_row_in_the_index():
    """The README's results table: each row names an INDEX.md anchor of a file or a row."""
    text = _read("README.md")
    table = [line for line in text.split("## Results", 1)[1].splitlines() if line.startswith("| ")][2:]
    assert table, "README.md has no results table"
    for line in table:
        assert "benchmarks/results/INDEX.md#" in line, f"a README figure without its row: {line}"


def test_the_index_is_what_the_report_writes_from_the_stored_files(tmp_path, monkeypatch):
    """`weightstream bench --report benchmarks/results --index ...`, regenerated into tmp_path from the
    repository root, gives the committed INDEX.md and docs/benchmarks.md byte for byte (plots in
    tmp_path: the committed ones are images, not compared)."""
    pytest.importorskip("matplotlib")
    monkeypatch.chdir(ROOT)
    index = tmp_path / "benchmarks" / "results" / "INDEX.md"
    md = tmp_path / "docs" / "benchmarks.md"
    argv = ["--report", "benchmarks/results", "--index", str(index), "--md", str(md),
            "--png-dir", str(tmp_path / "docs" / "figures")]
    assert cli.main(argv) == 0
    assert index.read_text() == _read("benchmarks/results/INDEX.md"), "regenerate INDEX.md"
    assert md.read_text() == _read("docs/benchmarks.md"), "regenerate docs/benchmarks.md"
    committed = sorted(os.listdir(os.path.join(ROOT, "docs", "figures")))
    assert sorted(os.listdir(tmp_path / "docs" / "figures")) == committed


def test_the_index_function_gives_the_committed_index():
    assert index_text(RESULTS) == _read("benchmarks/results/INDEX.md")


def test_results_folders_are_named_by_date_gpu_and_topic():
    """`<YYYY-MM-DD>_<h100|h200|cpu>_<topic>`, topic in lowercase words joined by `-`; nothing else at
    the top of benchmarks/results but INDEX.md; no folders inside; each folder has a README.md."""
    for good in ("2026-12-02_h200_llm-suite", "2026-12-05_cpu_flux-pipeline-plan", "2026-12-03_h100_qwen2.5"):
        assert FOLDER_RE.match(good), good
    for bad in ("h100_llm-suite", "2026-12-05_h100_Flux", "2026-12-05_a100_llm", "20261205_h100_llm",
                "2026-12-05_h100_", "2026-12-05_h100_llm_run1"):
        assert not FOLDER_RE.match(bad), bad
    assert folder_errors(RESULTS) == []
    folders = [e for e in os.listdir(RESULTS) if os.path.isdir(os.path.join(RESULTS, e))]
    assert len(folders) > 10
    assert [f for f in folders if not os.path.exists(os.path.join(RESULTS, f, "README.md"))] == []


def test_folder_errors_names_what_breaks_the_layout(tmp_path):
    (tmp_path / "2026-12-05_h100_llm-suite" / "cache").mkdir(parents=True)
    (tmp_path / "h100_run1").mkdir()
    (tmp_path / "suite.json").write_text("{}")
    errors = folder_errors(str(tmp_path))
    assert any(e.startswith("h100_run1: not") for e in errors)
    assert "2026-12-05_h100_llm-suite/cache: a folder inside a results folder" in errors
    assert "suite.json: a file outside the dated folders" in errors


def test_no_development_history_in_the_results_or_the_pages():
    """Results are named by date, GPU and topic, and the pages speak of the project, not of how it was
    worked on: no numbered work sessions or tickets in file names or text."""
    names = [os.path.relpath(os.path.join(d, f), RESULTS) for d, _, fs in os.walk(RESULTS) for f in fs]
    assert [n for n in names if HISTORY_RE.search(n)] == []
    texts = {n: open(os.path.join(RESULTS, n), errors="replace").read() for n in names}
    texts.update({p: _read(p) for p in [*PAGES, "CHANGELOG.md", "benchmarks/README.md"]})
    hits = {n: HISTORY_RE.findall(t) for n, t in texts.items() if HISTORY_RE.search(t)}
    assert hits == {}
