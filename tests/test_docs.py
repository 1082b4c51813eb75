"""The README and docs/ as a reader follows them: a README of at most 250 lines and pages of at most
400, every relative link leads to a file, and every `lattice ...` command shown parses with the
command line's own parser."""

import re
import shlex
from pathlib import Path

import pytest

from lattice.cli.main import build_parser

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")), ROOT / "benchmarks" / "README.md",
         RESULTS / "README.md", ROOT / "tests" / "README.md"]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _commands(text: str) -> list[str]:
    """The `lattice ...` command lines of a page's code blocks (a `$ ` prompt dropped, lines
    continued with a backslash joined, a trailing `# comment` cut); lines with `...` (an
    elided part) are not commands."""
    commands, in_block, pending = [], False, ""
    for line in text.splitlines():
        if line.startswith("```"):
            in_block, pending = not in_block, ""
            continue
        if not in_block:
            continue
        line = pending + line.strip()
        if line.endswith("\\"):
            pending = line[:-1] + " "
            continue
        pending = ""
        line = line.removeprefix("$ ")
        if line.startswith("lattice ") and "..." not in line:
            commands.append(line)
    return commands


def _argv(command: str) -> list[str]:
    words = shlex.split(command, comments=True)
    for cut in ("&&", "|", ";"):  # the lattice command alone
        if cut in words:
            words = words[:words.index(cut)]
    return words[1:]


@pytest.mark.fast
def test_the_readme_is_a_front_door_and_each_page_one_topic():
    """Catches the README growing back into a notebook (over 250 lines), a docs page past 400
    lines, where a reader stops finding things, or the docs keeping past runs ("run 36", a
    history folder) that belong in commit messages and issue notes."""
    assert len((ROOT / "README.md").read_text().splitlines()) <= 250
    pages = list((ROOT / "docs").rglob("*.md"))
    long = {p.name: n for p in pages if (n := len(p.read_text().splitlines())) > 400}
    assert not long, long
    past = re.compile(r"\b[Rr]un \d+\b|\b[Rr]uns \d+-\d+\b|before this change|history/")
    dated = [str(p.relative_to(ROOT)) for p in pages + [ROOT / "README.md"] if past.search(p.read_text())]
    assert dated == []
    examples = ("Run 31, before", "runs 40-42 gave", "each node runs 8 ranks")
    assert [bool(past.search(t)) for t in examples] == [True, True, False]


@pytest.mark.fast
def test_every_result_is_indexed_and_says_where_it_comes_from():
    """Catches a result file that nobody can place: one missing from benchmarks/results/README.md's
    index, a JSON without the command, commit and date that produced it, or numbered reruns piling
    up beside the current file (more than 32 files: one per benchmark)."""
    import json

    files = sorted(p.name for p in RESULTS.iterdir() if p.name != "README.md")
    index = (RESULTS / "README.md").read_text()
    assert len(files) <= 32 and not [f for f in files if f"`{f}`" not in index], files
    for name in (f for f in files if f.endswith(".json")):
        record = json.loads((RESULTS / name).read_text()).get("provenance", {})
        assert all(record.get(k) for k in ("command", "commit", "date")), (name, record)


@pytest.mark.fast
@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
    """Catches a link to a page, file or folder that was moved or never committed."""
    broken = []
    for target in LINK.findall(page.read_text()):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        path = (page.parent / target.split("#", 1)[0]).resolve()
        if not path.exists():
            broken.append(target)
    assert not broken, f"{page.name} links to what is not in the repository: {broken}"


@pytest.mark.fast
@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_command_shown_parses(page):
    """Catches a command in the docs with a flag that does not exist (renamed or never added), a
    value of the wrong type, or a subcommand that is gone: each parses with the CLI's own parser."""
    failures = [command for command in _commands(page.read_text()) if _parse_fails(command)]
    assert not failures, f"{page.name}: these commands do not parse: {failures}"


def test_the_checker_finds_a_broken_flag_and_a_broken_link(tmp_path):
    """The two checks above can fail: a planted command with a flag that does not exist and a
    planted link to a missing page are both reported."""
    text = "```bash\nlattice train --no-such-flag 3\nlattice train --steps 5\n```\n[x](docs/nope.md)\n"
    bad = [c for c in _commands(text) if _parse_fails(c)]
    assert bad == ["lattice train --no-such-flag 3"]
    assert LINK.findall(text) == ["docs/nope.md"] and not (ROOT / "docs/nope.md").exists()


def _parse_fails(command: str) -> bool:
    argv = _argv(command)
    try:
        build_parser(argv[0] if argv else None).parse_args(argv)
    except SystemExit:
        return True
    return False


CITATION = re.compile(r"references\.md#([a-z0-9-]+)")


def cited_papers(text: str) -> set[str]:
    return set(CITATION.findall(text))


def reference_anchors() -> set[str]:
    """The anchors of docs/references.md: its second-level headings, as GitHub makes them."""
    headings = re.findall(r"^## (.+)$", (ROOT / "docs" / "references.md").read_text(), re.M)
    return {re.sub(r"[^a-z0-9 -]", "", h.lower()).replace(" ", "-") for h in headings}


@pytest.mark.fast
def test_papers_are_cited_by_anchors_that_exist():
    """Catches a citation of a file that is not in the repository (`papers/000`, DESIGN.md) and
    one of a paper docs/references.md does not list: every `references.md#name` in the package,
    tests, benchmarks and docs is a heading of that page."""
    files = [f for folder in ("lattice", "tests", "benchmarks", "docs") for f in (ROOT / folder).rglob("*")
             if f.suffix in (".py", ".md") and f.name != "test_docs.py"]
    texts = {f: f.read_text() for f in files + [ROOT / "README.md"]}
    stale = [str(f.relative_to(ROOT)) for f, t in texts.items() if re.search(r"papers/0\d\d|DESIGN\.md", t)]
    assert stale == []
    anchors = reference_anchors()
    assert {"optimus", "megatron-lm", "3d", "super"} <= anchors
    unknown = {(str(f.relative_to(ROOT)), a) for f, t in texts.items() for a in cited_papers(t) - anchors}
    assert unknown == set()
    assert cited_papers("SUMMA (docs/references.md#optimus §2.4), see references.md#nope") - anchors == {"nope"}


def test_a_benchmark_writing_its_own_result_is_no_change_to_the_commit(tmp_path, monkeypatch):
    """Catches a result file's provenance saying "+changes" because the benchmark had already
    opened (truncated) its own output under benchmarks/results when it asked git, while a change
    to the code it measured is still named."""
    import importlib
    import subprocess

    provenance = importlib.import_module("lattice.bench.provenance")  # the module (the package exports the function)

    def git(*args):
        subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=tmp_path, check=True,
                       capture_output=True)

    (tmp_path / "benchmarks" / "results").mkdir(parents=True)
    (tmp_path / "code.py").write_text("x = 1\n")
    (tmp_path / "benchmarks" / "results" / "r.json").write_text("{}")
    git("init", "-q")
    git("add", "-A")
    git("commit", "-qm", "c")
    monkeypatch.setattr(provenance, "REPO", tmp_path)
    clean = provenance._commit()
    assert clean and not clean.endswith("+changes")
    (tmp_path / "benchmarks" / "results" / "r.json").write_text("")
    assert provenance._commit() == clean
    (tmp_path / "code.py").write_text("x = 2\n")
    assert provenance._commit() == clean + "+changes"
