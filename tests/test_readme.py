"""The README's Python example runs as written (the README must stay true)."""

from __future__ import annotations

import re
import subprocess
import sys

from tests.conftest import REPO


def test_readme_python_example_runs() -> None:
    text = (REPO / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert blocks, "README has no python example"
    result = subprocess.run(
        [sys.executable, "-c", blocks[0]], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert "layers" in result.stdout


def test_readme_first_two_commands_are_install_and_run() -> None:
    text = (REPO / "README.md").read_text()
    commands = re.findall(r"```bash\n(.*?)```", text, re.S)
    assert "pip install torch==2.13.0" in commands[0] and "hetpipe run" in commands[0]
    assert "pip install torch==2.13.0" in commands[1] and "pytest" in commands[1]
