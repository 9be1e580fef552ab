"""``hetpipe.train`` from a user's ``__main__``: an unguarded script is refused in one line
before any process starts; classes defined on standard input reach the workers by value."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from runtime.by_value import _guarded

pytestmark = pytest.mark.timeout(240)

SCRIPT = textwrap.dedent(
    """
    import torch
    from torch import nn
    from torch.utils.data import Dataset
    import hetpipe


    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(8, 16)
            self.b = nn.Linear(16, 4)

        def forward(self, x):
            return self.b(torch.relu(self.a(x)))


    class Data(Dataset):
        def __init__(self):
            g = torch.Generator().manual_seed(0)
            self.x = torch.randn(32, 8, generator=g)
            self.y = torch.randint(0, 4, (32,), generator=g)

        def __len__(self):
            return 32

        def __getitem__(self, i):
            return self.x[i], self.y[i]


    def my_loss(out, y):
        return nn.functional.cross_entropy(out, y)


    result = hetpipe.train(Net(), Data(), my_loss, stages=2, nm=1, batch_size=8, steps=2,
                           timeout=30.0)
    print("LOSSES", len(result.losses), all(l == l for l in result.losses))
    """
)


def _python(
    tmp_path: Path, *args: str, stdin: str | None = None
) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])}
    return subprocess.run(
        [sys.executable, *args], input=stdin, capture_output=True, text=True, cwd=tmp_path,
        env=env, timeout=200,
    )  # fmt: skip


def test_unguarded_script_is_refused_in_one_line(tmp_path: Path) -> None:
    script = tmp_path / "train_me.py"
    script.write_text(SCRIPT)
    done = _python(tmp_path, str(script))
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert "train_me.py:" in last
    assert 'put that call under `if __name__ == "__main__":`' in last
    assert "BrokenPipeError" not in done.stderr
    assert "LOSSES" not in done.stdout


def test_classes_defined_on_stdin_train(tmp_path: Path) -> None:
    done = _python(tmp_path, "-", stdin=SCRIPT)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "LOSSES 2 True" in done.stdout


@pytest.mark.parametrize(
    ("body", "line", "guarded"),
    [
        ("x = 1\ntrain()\n", 2, False),
        ("x = 1\nif __name__ == '__main__':\n    train()\n", 3, True),
        ("def main():\n    train()\n\nmain()\n", 4, False),
        ('if __name__ == "__main__":\n    import sys\n    main()\n', 3, True),
    ],
)
def test_guard_is_judged_by_the_calling_line(
    tmp_path: Path, body: str, line: int, guarded: bool
) -> None:
    path = tmp_path / "s.py"
    path.write_text(body)
    assert _guarded(str(path), line) is guarded
