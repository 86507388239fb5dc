"""The product describes itself: no source, test or user document cites the project's working
documents or its history (specification sections, work sessions, tracker items, paths outside the
repository).  What a user needs is in README.md and docs/."""

import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCANNED = ("src", "tests", "docs", "README.md", "bench")
SUFFIXES = (".py", ".md", ".txt", ".toml", ".yaml", ".yml", ".json", ".cfg", ".sh")
# each pattern once, case-insensitive; written so that this file does not match them
FORBIDDEN = {
    "a specification section": r"DESIGN\s*§",
    "the performance specification": r"PERF\.md",
    "a path outside the repository": r"\.\./shared/",
    "a work session": r"\bsession\s+\d+",
    "a tracker item": r"\b(?:issue|task)\s*#?\d+",
}


def _files():
    for entry in SCANNED:
        path = os.path.join(ROOT, entry)
        if os.path.isfile(path):
            yield path
            continue
        for folder, dirs, names in os.walk(path):
            dirs[:] = [d for d in dirs if not d.startswith(".") and d != "__pycache__"]
            yield from (os.path.join(folder, n) for n in names if n.endswith(SUFFIXES))


def find_citations(text: str) -> list[str]:
    """``what (matched text)`` for every forbidden citation in ``text``."""
    return [
        f"{what} ({m.group(0)!r})"
        for what, pattern in FORBIDDEN.items()
        for m in re.finditer(pattern, text, re.IGNORECASE)
    ]


def test_the_patterns_find_what_they_forbid():
    # the samples are assembled here so that this file itself holds none of them
    spec, perf = "DESIGN" + " \u00a7" + "1.9", "PERF" + ".md"
    found = find_citations(f"see {spec} and {perf}")
    assert [f.split(" (")[0] for f in found] == ["a specification section", "the performance specification"]
    samples = ["Is" + "sue 26 item 6", "fixed in ses" + "sion 12", "ta" + "sk #3", "../" + "shared/spec"]
    assert [len(find_citations(x)) for x in samples] == [1, 1, 1, 1]
    assert find_citations("the seed of the clip; an issue with the 3 heads; sessions of 2 users") == []


def test_no_file_cites_the_working_documents():
    me = os.path.abspath(__file__)
    hits = []
    for path in _files():
        if os.path.abspath(path) == me:
            continue
        with open(path, encoding="utf-8", errors="replace") as fh:
            for n, line in enumerate(fh, 1):
                hits += [f"{os.path.relpath(path, ROOT)}:{n}: {c}" for c in find_citations(line)]
    assert hits == [], "cite the repository's own docs instead:\n" + "\n".join(hits[:40])


def test_the_results_page_stays_a_results_page():
    """docs/benchmarks.md holds current tables with their commands, not a history: at most 300 lines."""
    with open(os.path.join(ROOT, "docs", "benchmarks.md"), encoding="utf-8") as f:
        n = len(f.read().splitlines())
    assert n <= 300, f"docs/benchmarks.md has {n} lines; keep current figures only (at most 300)"
