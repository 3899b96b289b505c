"""The README stays a front door and the documentation site stays whole: every page is in the nav, every link the
README makes leads somewhere, and every part of the README a page includes is marked. The site's strict build
(.ci/run, after lint) checks the pages' own links and anchors."""

from __future__ import annotations

import re

import markdown

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


def _numbered_steps(text: str) -> list[int]:
    """The numbers of the text's numbered list items (`3. …`), outside code blocks."""
    steps, fenced = [], False
    for line in text.splitlines():
        if re.match(r"\s*(```|~~~)", line):
            fenced = not fenced
        elif not fenced and (step := re.match(r"\s*(\d+)\. ", line)):
            steps.append(int(step.group(1)))
    return steps


def test_every_numbered_list_renders_as_one_list_numbered_as_written() -> None:
    """A step whose code block or table is not indented under it ends its list: the next step then renders as
    "1." of a new list, or as a paragraph. Each page, rendered with the site's Markdown extensions, holds as many
    lists as its steps numbered 1 and as many list items as it has steps."""
    extensions = ["admonition", "attr_list", "tables", "toc", "pymdownx.highlight", "pymdownx.superfences"]
    for page in [README, *sorted(DOCS.rglob("*.md"))]:
        text = page.read_text()
        html = re.sub(r"<pre.*?</pre>", "", markdown.markdown(text, extensions=extensions), flags=re.S)
        lists = re.findall(r"<ol[^>]*>.*?</ol>", html, re.S)
        steps = _numbered_steps(text)
        assert len(lists) == steps.count(1), (page.name, steps, len(lists))
        assert sum(listed.count("<li") for listed in lists) == len(steps), (page.name, steps)
