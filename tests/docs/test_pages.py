"""The documentation stands on its own: no page leans on a document outside the
repository, and every relative link points at a file that exists."""

from __future__ import annotations

import re

from tests.brokerproc import ROOT

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def test_no_page_cites_the_requirements_document_instead_of_stating_the_rule():
    # references.md says once what the code comments' "BROKER-SPEC section N"
    # means and which page states each section; no other page cites it.
    citing = [p.name for p in PAGES if "BROKER-SPEC" in p.read_text()]
    assert citing == ["references.md"], citing
    text = (ROOT / "docs" / "references.md").read_text()
    table = text[text.index("## The project's requirements"):]
    sections = re.findall(r"^\| (\d+) \|.*\| (.+) \|$", table, re.M)
    assert [int(n) for n, _ in sections] == list(range(1, 11))
    for _, pages in sections:
        for target in LINK.findall(pages):
            assert (ROOT / "docs" / target.split("#")[0]).exists(), target


def test_relative_links_resolve():
    broken = []
    for page in PAGES:
        for target in LINK.findall(page.read_text()):
            if "://" in target or target.startswith(("#", "mailto:")):
                continue
            path = (page.parent / target.split("#")[0]).resolve()
            if not path.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target}")
    assert not broken, broken
