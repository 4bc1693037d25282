"""Every reference in the repo's code and docs resolves inside the repo: no citation of files that
live outside it (the old spec/, PERF.md, API.md, ../shared), and every `docs/<file>.md §N` names an
existing file with a heading numbered N."""

from __future__ import annotations

import os
import re
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUTSIDE = re.compile(r"(?<![\w/.])(spec/[\w.]+|PERF\.md|API\.md|\.\./shared)")
DOC_REF = re.compile(r"docs/([\w-]+\.md)(?:\s+(§\s?[\d.]+(?:\s*(?:[-–,]|and)\s*§?\s?[\d.]+)*))?")
SECTION = re.compile(r"§\s?(\d+(?:\.\d+)*)")


def tracked_text_files():
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout.split()
    keep = (".py", ".md", ".sh", ".toml", "Makefile")
    for rel in out:
        # raw logs of earlier benchmark runs are records, not references
        if rel.endswith(keep) and not rel.startswith("benchmarks/results/") and os.path.isfile(os.path.join(ROOT, rel)):
            yield rel


def headings(doc):
    nums = set()
    for line in open(os.path.join(ROOT, "docs", doc), encoding="utf-8"):
        m = re.match(r"#+\s+(\d+(?:\.\d+)*)\.?\s", line)
        if m:
            nums.add(m.group(1))
    return nums


def test_nothing_cites_files_outside_the_repo():
    bad = []
    for rel in tracked_text_files():
        if rel == "tests/test_docs_references.py":
            continue
        for i, line in enumerate(open(os.path.join(ROOT, rel), encoding="utf-8", errors="replace"), 1):
            for m in OUTSIDE.finditer(line):
                bad.append(f"{rel}:{i}: {m.group(0)}")
    assert bad == []


def test_every_docs_reference_resolves():
    bad, checked = [], 0
    for rel in tracked_text_files():
        if rel == "tests/test_docs_references.py":
            continue
        for i, line in enumerate(open(os.path.join(ROOT, rel), encoding="utf-8", errors="replace"), 1):
            for m in DOC_REF.finditer(line):
                doc, sections = m.group(1), m.group(2)
                if not os.path.isfile(os.path.join(ROOT, "docs", doc)):
                    bad.append(f"{rel}:{i}: docs/{doc} does not exist")
                    continue
                checked += 1
                have = headings(doc)
                for num in SECTION.findall(sections or ""):
                    num = num.rstrip(".")
                    if num not in have:
                        bad.append(f"{rel}:{i}: docs/{doc} has no section {num}")
    assert bad == []
    assert checked > 20   # the scan found the references (it cannot pass by matching nothing)


@pytest.mark.parametrize("text, ok", [("see docs/mamba1.md §3.3", True), ("see docs/mamba1.md §42.1", False),
                                      ("see docs/nope.md", False)])
def test_the_checker_can_fail(text, ok):
    m = DOC_REF.search(text)
    doc = m.group(1)
    exists = os.path.isfile(os.path.join(ROOT, "docs", doc))
    good = exists and all(n in headings(doc) for n in SECTION.findall(m.group(2) or ""))
    assert good == ok
