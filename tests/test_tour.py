"""README's API tour is ``examples/tour.py`` word for word, and it runs."""

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOUR = os.path.join(ROOT, "examples", "tour.py")


def test_readme_shows_the_tour_file():
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read()
    with open(TOUR) as f:
        tour = f.read()
    section = readme[readme.index("## API tour"):]
    block = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    assert block == tour


def test_tour_runs():
    out = subprocess.run([sys.executable, TOUR], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert "KernelPath(op='paged_attention', path='kernel'" in out.stdout
