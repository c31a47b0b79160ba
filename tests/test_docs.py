"""The repository's Markdown links lead somewhere: every relative link names a file that exists, and
every ``#anchor`` (in the same file or another) a heading that file has.

The README, protocol.md, the performance log and bench/results cite one another by heading, and a
heading reworded or a section moved breaks those links silently; a reader then lands at the top of a
2,000-line page. Anchors follow GitHub's rule: the heading in lower case, backticks and punctuation
other than ``-`` and ``_`` dropped, spaces made ``-``, and ``-1``, ``-2`` ... after a repeat.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

#: Folders whose Markdown is not the project's own (installed packages, tools' caches, test output).
SKIPPED = {".git", ".venv", "node_modules", "test-artifacts", ".mypy_cache", ".ruff_cache", ".pytest_cache"}

_LINK = re.compile(r"\]\(([^)\s]+)\)")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
_FENCE = re.compile(r"^\s*(```|~~~)")


def anchor(heading: str) -> str:
    """GitHub's anchor for a heading's text (before any ``-N`` for a repeat)."""
    text = heading.replace("`", "").strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def prose_lines(text: str) -> list[str]:
    """The lines outside fenced code blocks (a ``# comment`` in a shell block is not a heading)."""
    lines, fenced = [], False
    for line in text.splitlines():
        if _FENCE.match(line):
            fenced = not fenced
        elif not fenced:
            lines.append(line)
    return lines


def anchors(text: str) -> set[str]:
    """Every anchor a Markdown text's headings make."""
    found: set[str] = set()
    seen: dict[str, int] = {}
    for line in prose_lines(text):
        match = _HEADING.match(line)
        if match:
            base = anchor(match.group(2))
            count = seen.get(base, 0)
            seen[base] = count + 1
            found.add(base if count == 0 else f"{base}-{count}")
    return found


def broken_links(path: Path, read: dict[Path, str]) -> list[str]:
    """Each relative link in ``path`` whose file or anchor is missing, as ``target (why)``."""
    broken = []
    for line in prose_lines(read[path]):
        for target in _LINK.findall(line):
            if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto: ...
                continue
            file, _, fragment = target.partition("#")
            destination = (path.parent / file).resolve() if file else path
            if not destination.exists():
                broken.append(f"{target} (no such file)")
            elif fragment and destination.suffix == ".md":
                text = read.get(destination)
                if text is None:
                    text = read[destination] = destination.read_text(encoding="utf-8")
                if fragment not in anchors(text):
                    broken.append(f"{target} (no such heading)")
    return broken


def markdown_files() -> list[Path]:
    """The project's own Markdown: what git tracks or would (not what it ignores: a virtual environment
    the README has a reader make, models, test output); without git, every file outside ``SKIPPED``."""
    import subprocess

    try:
        listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "*.md"],
                                cwd=ROOT, capture_output=True, text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return sorted(path for path in ROOT.rglob("*.md") if not SKIPPED & set(path.relative_to(ROOT).parts))
    return sorted(ROOT / line for line in listed.splitlines() if (ROOT / line).is_file())


def test_anchors_follow_githubs_rule() -> None:
    text = "# Quick start\n## On a GPU (issue 17 item 6)\n### `--max-batch-ms`, the time bound\n## Quick start\n"
    assert anchors(text) == {"quick-start", "on-a-gpu-issue-17-item-6", "--max-batch-ms-the-time-bound",
                             "quick-start-1"}
    assert anchors("```sh\n# not a heading\n```\n") == set()


def test_a_missing_file_or_heading_is_reported(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("# Here\n[a](#here) [b](#gone) [c](other.md#there) [d](none.md) [e](https://x.org/#y)\n"
                    "```\n[f](#inside-code)\n```\n")
    (tmp_path / "other.md").write_text("# Elsewhere\n")
    read = {page: page.read_text()}
    assert broken_links(page, read) == ["#gone (no such heading)", "other.md#there (no such heading)",
                                        "none.md (no such file)"]


def test_every_relative_link_in_the_repositorys_markdown_leads_somewhere() -> None:
    files = markdown_files()
    assert ROOT / "README.md" in files and ROOT / "protocol.md" in files
    read = {path: path.read_text(encoding="utf-8") for path in files}
    broken = {str(path.relative_to(ROOT)): links for path in files if (links := broken_links(path, read))}
    assert not broken, f"links to a file or heading that is not there: {broken}"


def test_the_readmes_layout_names_every_module_of_the_server() -> None:
    """A trial looked for ``load_server``'s module in "Layout" and did not find it: every module of
    ``fillmask_server`` is named there (``name.py``)."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    layout = readme[readme.index("\n## Layout\n"):]
    modules = sorted(path.name for path in (ROOT / "fillmask_server").glob("*.py") if path.name != "__init__.py")
    assert len(modules) > 30
    assert [name for name in modules if f"`{name}`" not in layout and f"fillmask_server/{name}`" not in layout] == []


def test_each_machine_column_at_a_glance_links_to_that_machines_runs() -> None:
    """A session's update once put the family-26 EPYC's run files in the AVX2 column's "from" cell: each
    column's result files are named for its machine (``bench/results/*-zen4-*``, ``*avx512*``, ...)."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    table = readme[readme.index("\n### At a glance\n"):].split("\n\n")[2].splitlines()
    header = [cell.strip() for cell in table[0].strip("|").split("|")]
    sources = [cell.strip() for cell in next(r for r in table if r.startswith("| from |")).strip("|").split("|")]
    tags = {"Zen 4": "zen4", "family 26": "avx512", "AVX2": "avx2", "Xeon": "xeon"}
    assert len(header) == len(sources) == 6
    for name, cell in zip(header[2:], sources[2:], strict=True):
        tag = next(tag for key, tag in tags.items() if key in name)
        files = re.findall(r"\(bench/results/([^)]+)\)", cell)
        assert files and all(tag in file for file in files), (name, [f for f in files if tag not in f])
