"""The README's claims that can be checked quickly: its Python example runs as printed,
and its two set-up commands are the ones CI runs."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
README = (REPO / "README.md").read_text()


def test_the_python_example_runs_and_prints_what_it_says():
    [example] = re.findall(r"```python\n(.*?)```", README, flags=re.S)
    proc = subprocess.run([sys.executable, "-c", example], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [str([x * x + 1 for x in range(10)]), "49"]


def test_ci_runs_the_readme_test_command_verbatim():
    [block] = re.findall(r"```bash\n(.*?)```", README, flags=re.S)
    commands = [line.split("#")[0].strip() for line in block.strip().splitlines()]
    assert len(commands) == 2 and all(c.startswith("bin/setup && ") for c in commands)
    assert commands[1] in (REPO / ".ci" / "run").read_text()
    assert "bin/stageb-pool --gpus cpu:2 configs/demo.yaml" in commands[0]
