"""README.md's python blocks run as written (a fresh interpreter, from the repository root)."""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"


def python_blocks(text: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", text, flags=re.S | re.M)


def test_readme_python_blocks_run():
    blocks = python_blocks(README.read_text())
    assert blocks, "README.md has no ```python block"
    for block in blocks:
        r = subprocess.run([sys.executable, "-c", block], capture_output=True, text=True, timeout=300, cwd=ROOT)
        assert r.returncode == 0, f"README block failed:\n{block}\n{r.stderr[-3000:]}"


def test_readme_points_inside_the_repository():
    text = README.read_text()
    assert "../" not in text and "shared/DESIGN" not in text
    for link in re.findall(r"\]\(([^)#]+)", text):
        if not link.startswith("http"):
            assert (ROOT / link).exists(), link
