"""The README stays a front door and the documentation site stays whole: every page is in the nav, every link the
README makes leads somewhere, and every part of the README a page includes is marked. The site's strict build
(.ci/run, after lint) checks the pages' own links and anchors."""

from __future__ import annotations

import re

from tests.test_readme import DOCS, README, ROOT

MKDOCS = ROOT / "mkdocs.yml"
GENERATED = DOCS / "hooks" / "api_reference.py"  # writes reference/<tag>-api.md when the site is built


def nav_pages() -> list[str]:
    """The pages mkdocs.yml's nav names, relative to docs/ (`- Title: page.md`)."""
    return re.findall(r"^\s*- [^:\n]+:\s*(\S+\.md)\s*$", MKDOCS.read_text(), re.M)


def test_every_page_is_in_the_nav_and_every_nav_entry_is_a_page() -> None:
    named = nav_pages()
    written = {str(page.relative_to(DOCS)) for page in DOCS.rglob("*.md")}
    assert written - set(named) == set()
    generated = {page for page in named if page not in written}
    assert generated == {"reference/trainer-api.md"}, generated  # the one tag the OpenAPI document has
    assert len(named) == len(set(named)), named


def test_the_readme_fits_on_a_page() -> None:
    assert len(README.read_text().splitlines()) <= 250


def test_every_link_in_the_readme_leads_to_a_file() -> None:
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", README.read_text())
    local = [link for link in links if "://" not in link]
    assert len(local) >= 10, local
    assert [link for link in local if not (ROOT / link).is_file()] == []


def test_every_part_of_the_readme_a_page_includes_is_marked_there() -> None:
    readme = README.read_text()
    included = {
        (page.name, section)
        for page in DOCS.rglob("*.md")
        for section in re.findall(r'^--8<-- "README\.md:(\w+)"$', page.read_text(), re.M)
    }
    assert {section for _, section in included} >= {"intro", "setup", "quickstart", "run", "train"}
    for page, section in included:
        start, end = f"<!-- --8<-- [start:{section}] -->", f"<!-- --8<-- [end:{section}] -->"
        assert readme.count(start) == 1 and readme.count(end) == 1, (page, section)
        assert readme.index(start) < readme.index(end), (page, section)


def test_the_api_reference_hook_is_where_the_site_loads_it() -> None:
    assert GENERATED.is_file()
    assert f"  - {GENERATED.relative_to(ROOT)}" in MKDOCS.read_text()
