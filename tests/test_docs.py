"""The documentation runs: every ```python block of README.md and docs/*.md executes on the CPU, each in a fresh
namespace (README's tour is ``examples/tour.py`` word for word, run as that file), and every relative link points
to a file and heading that exist.

A block that cannot run here says so in its fence, with the reason: ```python no-run: <why>. Shell blocks are not
run (the commands they show have tests of their own)."""

import glob
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOUR = os.path.join(ROOT, "examples", "tour.py")
DOCS = ["README.md", *sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))]
NO_RUN = "python no-run:"
MAX_NO_RUN = 3  # blocks shown but not run stay the exception

FENCE = re.compile(r"^```(.*)$")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _read(path: str) -> str:
    with open(os.path.join(ROOT, path)) as f:
        return f.read()


def _fences(path: str) -> list[tuple[int, str, str]]:
    """``(line of the opening fence, info string, body)`` of each fenced block of ``path``."""
    blocks, opened, body = [], None, []
    for n, line in enumerate(_read(path).splitlines(), 1):
        m = FENCE.match(line)
        if opened is None and m:
            opened, body = (n, m.group(1).strip()), []
        elif opened is not None and line == "```":
            blocks.append((*opened, "".join(body)))
            opened = None
        elif opened is not None:
            body.append(line + "\n")
    assert opened is None, f"{path}:{opened[0]}: fence never closed"
    return blocks


def _python_blocks() -> list[tuple[str, int, str, str]]:
    """``(file, line, info, code)`` of every python block; any other ``python...`` info string is an error."""
    out = []
    for path in DOCS:
        for line, info, code in _fences(path):
            if info.split(" ")[0] != "python":
                continue
            assert info == "python" or info.startswith(NO_RUN) and info[len(NO_RUN):].strip(), (
                f"{path}:{line}: a python block's fence is ```python, or ```{NO_RUN} <why it cannot run here>; "
                f"got ```{info}")
            out.append((path, line, info, code))
    return out


BLOCKS = _python_blocks()


def test_blocks_found_and_no_run_blocks_few():
    assert sum(path.startswith("docs") for path, *_ in BLOCKS) >= 5 and any(p == "README.md" for p, *_ in BLOCKS)
    skipped = [f"{path}:{line}" for path, line, info, _ in BLOCKS if info != "python"]
    assert len(skipped) <= MAX_NO_RUN, f"blocks marked no-run: {skipped}; make them runnable on the CPU"


@pytest.mark.parametrize("path, line, info, code", BLOCKS, ids=[f"{p}:{n}" for p, n, _, _ in BLOCKS])
def test_block_runs(path, line, info, code):
    if info != "python":
        pytest.skip(info)
    if code == _read(TOUR):
        pytest.skip("the tour: run as examples/tour.py by test_tour_runs")
    # padded to its place in the file, so a traceback names the file's own lines
    exec(compile("\n" * line + code, os.path.join(ROOT, path), "exec"), {"__name__": "__main__"})


def test_readme_shows_the_tour_file():
    section = _read("README.md").split("## API tour", 1)[1]
    assert re.search(r"```python\n(.*?)```", section, re.S).group(1) == _read(TOUR)


def test_tour_runs():
    out = subprocess.run([sys.executable, TOUR], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert "KernelPath(op='paged_attention', path='kernel'" in out.stdout


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped (``_`` and ``-`` kept), spaces to ``-``."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _prose(path: str) -> str:
    """``path`` without its fenced blocks (a ``#`` there is a comment, brackets are code)."""
    return re.sub(r"^```.*?^```$", "", _read(path), flags=re.S | re.M)


def _anchors(path: str) -> set[str]:
    """The anchors of ``path``'s headings; a repeated heading's get ``-1``, ``-2``, ... as on GitHub."""
    seen: dict[str, int] = {}
    for heading in re.findall(r"^#{1,6} (.+)$", _prose(path), re.M):
        s = _slug(heading)
        seen[s] = seen.get(s, -1) + 1
    return {s if i == 0 else f"{s}-{i}" for s, n in seen.items() for i in range(n + 1)}


def _links(path: str) -> list[str]:
    text = re.sub(r"`[^`\n]*`", "", _prose(path))  # code spans hold brackets that are not links
    return [t for t in LINK.findall(text) if not re.match(r"[a-z]+:", t)]


@pytest.mark.parametrize("path", DOCS)
def test_relative_links_resolve(path):
    for link in _links(path):
        target, _, anchor = link.partition("#")
        file = os.path.normpath(os.path.join(os.path.dirname(path), target)) if target else path
        assert os.path.exists(os.path.join(ROOT, file)), f"{path}: link {link!r}: no file {file}"
        if anchor:
            assert file.endswith(".md"), f"{path}: link {link!r}: an anchor into a file that is not markdown"
            assert anchor in _anchors(file), f"{path}: link {link!r}: {file} has no heading #{anchor}"
