"""The README stays a five-minute read, and the docs it points to are there: every relative link of the
README and of the docs/ pages reaches a file (and a heading, when it names one), docs/index.md links
every docs page, and every file docs/architecture.md names exists."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def links(page: Path) -> list[str]:
    """The link targets of a Markdown page, outside its code blocks."""
    return LINK.findall(FENCE.sub("", page.read_text(encoding="utf-8")))


def local_links(page: Path) -> list[tuple[str, Path, str]]:
    """(link as written, the file it names, its #anchor or '') for every link that is not a URL."""
    out = []
    for target in links(page):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        out.append((target, (page.parent / path).resolve() if path else page, anchor))
    return out


def slugs(page: Path) -> set[str]:
    """The anchors GitHub gives a page's headings: lower case, punctuation dropped, spaces as hyphens."""
    text = FENCE.sub("", page.read_text(encoding="utf-8"))
    headings = re.findall(r"^#{1,6}\s+(.+?)\s*$", text, re.M)
    return {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in headings}


def docs_pages() -> list[Path]:
    return sorted(p for p in DOCS.rglob("*.md") if p != DOCS / "index.md")


def broken(page: Path) -> list[str]:
    out = []
    for target, path, anchor in local_links(page):
        if not path.exists():
            out.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
        elif anchor and path.suffix == ".md" and anchor not in slugs(path):
            out.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    return out


def test_readme_is_at_most_250_lines():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").count("\n")
    assert lines <= 250, f"README.md has {lines} lines; move detail to a docs/ page and link it"


def test_every_link_of_the_readme_reaches_a_file_and_heading():
    assert broken(ROOT / "README.md") == []


def test_the_readme_links_the_docs_index():
    assert DOCS / "index.md" in {path for _, path, _ in local_links(ROOT / "README.md")}


def test_every_link_of_the_docs_pages_reaches_a_file_and_heading():
    assert [b for page in [DOCS / "index.md", *docs_pages()] for b in broken(page)] == []


def test_the_docs_index_links_every_docs_page():
    linked = {path for _, path, _ in local_links(DOCS / "index.md")}
    assert [str(p.relative_to(ROOT)) for p in docs_pages() if p.resolve() not in linked] == []


def test_the_readme_quickstart_runs_the_ci_test_command():
    # .ci/run calls python3 where the README says python: the same pytest command either way
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8").strip().splitlines()[-1]
    assert ci.startswith("python3 -m pytest ")
    assert f"&& python {ci.removeprefix('python3 ')}\n" in (ROOT / "README.md").read_text(encoding="utf-8")


# A file path as docs/architecture.md writes one: from the repository root (nandoctor/..., tests/...,
# bench/...), from the package (run/session.py, knowledge/rules.yaml) or a bare module name (session.py).
FILE_PATH = re.compile(r"(?<![\w./-])((?:[\w.-]+/)*[\w.-]+\.(?:py|yaml|j2))(?![\w/])")


def named_files(page: Path) -> list[str]:
    """Every source, rule or template file a page names, in prose, in `code` and in its diagram."""
    return sorted(set(FILE_PATH.findall(page.read_text(encoding="utf-8"))))


def missing_files(page: Path) -> list[str]:
    package = ROOT / "nandoctor"
    known = {p.name for p in [*package.rglob("*"), *(ROOT / "tests").rglob("*")]}
    out = []
    for name in named_files(page):
        if name.startswith(("nandoctor/", "tests/", "bench/")):
            found = (ROOT / name).is_file()
        elif "/" in name:
            found = (package / name).is_file()
        else:
            found = name in known
        if not found:
            out.append(name)
    return out


def test_every_file_the_architecture_page_names_exists():
    page = DOCS / "architecture.md"
    assert len(named_files(page)) > 50  # the pattern still finds the page's paths
    assert missing_files(page) == []
