"""README.md and docs/ stay true to the repository: generated tables match the committed CSVs, relative links point at
files and headings that exist, the sections the code cites exist, and the README keeps its test command."""

from __future__ import annotations

import os
import re
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = ["README.md", "CHANGELOG.md"] + [
    os.path.join("docs", f) for f in sorted(os.listdir(os.path.join(REPO, "docs")))
]


def _read(rel: str) -> str:
    with open(os.path.join(REPO, rel)) as f:
        return f.read()


def _anchor(heading: str) -> str:
    """GitHub's anchor of a markdown heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(rel: str) -> set[str]:
    body = re.sub(r"```.*?```", "", _read(rel), flags=re.DOTALL)
    return {_anchor(m.group(1)) for m in re.finditer(r"^#+ (.+)$", body, flags=re.MULTILINE)}


def test_generated_tables_match_the_committed_csvs():
    sys.path.insert(0, os.path.join(REPO, "benchmarks"))
    try:
        import docs_tables
    finally:
        sys.path.pop(0)
    assert docs_tables.main(["--check"]) == 0, "run python benchmarks/docs_tables.py"


@pytest.mark.parametrize("page", PAGES)
def test_relative_links_resolve(page):
    text = re.sub(r"```.*?```", "", _read(page), flags=re.DOTALL)
    base = os.path.dirname(page)
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        rel = os.path.normpath(os.path.join(base, path)) if path else page
        assert os.path.exists(os.path.join(REPO, rel)), f"{page}: link to missing {target}"
        if anchor and rel.endswith(".md"):
            assert anchor in _anchors(rel), f"{page}: no heading for #{anchor} in {rel}"


def test_sections_the_code_cites_exist():
    assert "prefix-trees" in _anchors("docs/how-it-works.md")  # grpo_mem/ops/attention.py
    assert "sharded-training-on-cpu" in _anchors("docs/distributed.md")  # tests/distributed/dist_worker.py
    assert "triton-head-kernels-resources-at-the-shipped-block-sizes-aot-compiled-without-a-gpu" in _anchors(
        "docs/kernels.md"
    )  # grpo_mem/ops/logprobs_triton.py
    assert "fp32-accuracy" in _anchors("docs/kernels.md")  # csrc/linear_logprobs.cpp, tests/model/test_precision.py


def test_readme_is_short_and_keeps_its_test_command():
    readme = _read("README.md")
    assert len(readme.splitlines()) < 300
    lines = readme.splitlines()
    i = lines.index("<!-- test-command -->")
    assert lines[i + 1] == "```bash" and "pytest" in lines[i + 2]  # what .ci/run reads with awk
