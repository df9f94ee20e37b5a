"""The docs a newcomer walks: README stays short and keeps its set-up commands on the
first screen, every relative link in README.md and docs/*.md reaches a file and
heading that exist, and every doc is reachable from README."""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
README_MAX_LINES = 300
FIRST_SCREEN_LINES = 25
"""About what a terminal or a repository page shows before the reader scrolls."""

FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
INLINE_CODE = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.M)


def _prose(text: str) -> str:
    """The text without code, whose brackets and hashes are not links or headings."""
    return INLINE_CODE.sub("", FENCE.sub("", text))


def _anchors(path: Path) -> set[str]:
    """The anchors a repository page gives the file's headings (GitHub's rule: lower
    case, punctuation dropped, spaces to hyphens, a repeated one suffixed -1, -2...)."""
    seen: dict[str, int] = {}
    anchors = set()
    for title in HEADING.findall(FENCE.sub("", path.read_text())):
        text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", title).replace("`", "")
        slug = re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        anchors.add(slug if count == 0 else f"{slug}-{count}")
    return anchors


def _links(path: Path) -> list[str]:
    links: list[str] = LINK.findall(_prose(path.read_text()))
    return links


def _relative(target: str) -> bool:
    return not re.match(r"^[a-z][a-z0-9+.-]*:", target)  # http:, https:, mailto:


@pytest.mark.parametrize("path", [README, *DOCS], ids=lambda p: p.name)
def test_relative_links_reach_a_file_and_a_heading(path: Path) -> None:
    broken = []
    for target in filter(_relative, _links(path)):
        file_part, _, anchor = target.partition("#")
        resolved = (path.parent / unquote(file_part)).resolve() if file_part else path
        if not resolved.exists():
            broken.append(f"{target}: no file {resolved.relative_to(ROOT)}")
        elif anchor and resolved.suffix == ".md" and anchor not in _anchors(resolved):
            broken.append(f"{target}: no heading #{anchor} in {resolved.relative_to(ROOT)}")
    assert not broken, f"{path.relative_to(ROOT)}:\n" + "\n".join(broken)


def test_every_doc_is_linked_from_readme() -> None:
    linked = {
        (README.parent / target.partition("#")[0]).resolve()
        for target in filter(_relative, _links(README))
    }
    missing = [doc.name for doc in DOCS if doc.resolve() not in linked]
    assert not missing, f"docs README.md does not link: {missing}"


def test_readme_is_short_and_starts_with_the_set_up_commands() -> None:
    lines = README.read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, (
        f"README.md has {len(lines)} lines; move detail to docs/ (at most {README_MAX_LINES})"
    )
    first_screen = "\n".join(lines[:FIRST_SCREEN_LINES])
    commands = re.findall(r"^make (\w+)\b", first_screen, re.M)
    assert commands == ["demo", "test"], commands


def test_the_set_up_commands_are_make_targets() -> None:
    targets = set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), re.M))
    assert {"demo", "test", "setup"} <= targets


def test_anchors_follow_the_repository_rule(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "# A title\n## KV events: the tiers' blocks next to the engine's\n"
        "```sh\n# not a heading\n```\n## `admission: reused` on other workloads\n"
        "## Notes\n## Notes\n"
    )
    assert _anchors(page) == {
        "a-title",
        "kv-events-the-tiers-blocks-next-to-the-engines",
        "admission-reused-on-other-workloads",
        "notes",
        "notes-1",
    }
