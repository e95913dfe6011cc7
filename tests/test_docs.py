"""The documentation stays true to the repository: links resolve, cited sections exist, the worked example runs.

- Every relative link in README.md and docs/*.md names a file or folder that exists, and a `#anchor` into a
  Markdown page matches one of its headings under GitHub's slug rules (lower case, punctuation dropped, spaces
  to hyphens, repeats numbered -1, -2, ...). Links inside code blocks and code spans are not links.
- Every `docs/<page>.md §N` cited in the code and configs is a numbered heading `N.` of that page.
- The Python block under docs/architecture.md's worked-example heading runs in this process: its asserts (a
  parity check of a toy step against the one-device GSPMD step) are this test's.
"""

from __future__ import annotations

import collections
import os
import pathlib
import re
import runpy

import pytest

import shardkit as sk

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]
WORKED_EXAMPLE = "Worked example: an explicit data-parallel step"

_FENCE = re.compile(r"^\s*(```|~~~)")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
_CODE_SPAN = re.compile(r"(`+)(.+?)\1")
_LINK = re.compile(r"\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_SCHEME = re.compile(r"^[a-z][a-z0-9+.-]*:", re.I)
_CITED = re.compile(r"docs/([\w-]+\.md) §(\d+)")


def _prose_lines(path: pathlib.Path) -> list[tuple[int, str]]:
    """(line number, text) of the lines outside fenced code blocks."""
    out, fence = [], None
    for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        m = _FENCE.match(line)
        if m and (fence is None or m.group(1) == fence):
            fence = m.group(1) if fence is None else None
            continue
        if fence is None:
            out.append((i, line))
    return out


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text: its rendered text lower-cased, characters other than letters,
    digits, '_', '-' and spaces dropped, each space a hyphen."""
    text = _CODE_SPAN.sub(lambda m: m.group(2), heading)
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", text)  # a link renders as its text
    text = re.sub(r"<[^>]+>", "", text).replace("*", "")  # inline HTML, emphasis
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def anchors(path: pathlib.Path) -> set[str]:
    seen: collections.Counter[str] = collections.Counter()
    out = set()
    for _, line in _prose_lines(path):
        m = _HEADING.match(line)
        if m:
            base = slug(m.group(2))
            out.add(base if not seen[base] else f"{base}-{seen[base]}")
            seen[base] += 1
    return out


def links(path: pathlib.Path) -> list[tuple[int, str]]:
    return [(i, m.group(1)) for i, line in _prose_lines(path) for m in _LINK.finditer(_CODE_SPAN.sub("", line))]


def test_the_pages_exist():
    names = {p.name for p in DOCS.glob("*.md")}
    assert {"algorithms.md", "jax_pitfalls.md", "architecture.md"} <= names
    assert links(ROOT / "README.md"), "no link found in README.md: the link parser is broken"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    bad = []
    for line, target in links(page):
        if _SCHEME.match(target):  # https:, mailto: ... are not checked here
            continue
        file, _, anchor = target.partition("#")
        dest = (page.parent / file).resolve() if file else page
        if not dest.exists():
            bad.append(f"{page.name}:{line}: {target} -> {dest} does not exist")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(f"{page.name}:{line}: {target}: no heading of {dest.name} has the anchor #{anchor}")
    assert not bad, "\n".join(bad)


def test_sections_cited_in_the_code_exist():
    files = []
    for folder, dirs, names in os.walk(ROOT):  # the repository's own files: not .venv, caches or runs
        dirs[:] = [d for d in dirs if not d.startswith(".") and d not in ("runs", "__pycache__")]
        files += [pathlib.Path(folder, n) for n in names if n.endswith((".py", ".toml"))]
    numbered = {}
    bad = []
    for path in files:
        for m in _CITED.finditer(path.read_text(encoding="utf-8", errors="replace")):
            page, n = DOCS / m.group(1), m.group(2)
            if page not in numbered:
                heads = (
                    [h.group(2) for _, line in _prose_lines(page) if (h := _HEADING.match(line))]
                    if page.exists()
                    else []
                )
                numbered[page] = {h.split(".", 1)[0] for h in heads if re.match(r"\d+\.", h)}
            if n not in numbered[page]:
                bad.append(f"{path.relative_to(ROOT)}: {m.group(0)} (no such numbered section)")
    assert not bad, "\n".join(bad)


def worked_example() -> str:
    """The one ```python block between the worked-example heading and the next heading of its level or above."""
    lines = (DOCS / "architecture.md").read_text(encoding="utf-8").splitlines()
    start = next(i for i, line in enumerate(lines) if _HEADING.match(line) and WORKED_EXAMPLE in line)
    level = len(_HEADING.match(lines[start]).group(1))
    blocks, current, fence = [], None, False
    for line in lines[start + 1 :]:
        if _FENCE.match(line):
            if not fence:
                current = [] if line.strip() == "```python" else None
            elif current is not None:
                blocks.append("\n".join(current))
            fence = not fence
            continue
        if fence:
            if current is not None:
                current.append(line)
        elif (m := _HEADING.match(line)) and len(m.group(1)) <= level:
            break
    assert len(blocks) == 1, f"the worked example must be one python block, found {len(blocks)}"
    return blocks[0] + "\n"


def test_the_worked_example_runs(tmp_path):
    script = tmp_path / "worked_example.py"
    script.write_text(worked_example(), encoding="utf-8")
    before = (set(sk.dispatch.STEPS), set(sk.STRATEGIES))
    runpy.run_path(str(script), run_name="__main__")  # its asserts are the test
    assert (set(sk.dispatch.STEPS), set(sk.STRATEGIES)) == before, "the example must unregister what it adds"
