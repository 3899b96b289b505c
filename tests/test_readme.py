"""The README's quickstart runs as written against a live trajproxy."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

README = Path(__file__).parent.parent / "README.md"


@pytest.mark.settings(trainer_token=None)  # the token `trajproxy serve` makes and keeps, as a user's would be
def test_the_quickstart_runs_as_written(server: Any) -> None:
    snippet = re.search(r"```python\n(.*?)```", README.read_text(), re.DOTALL)
    assert snippet is not None, "the README lost its quickstart"
    code = snippet.group(1).replace("http://127.0.0.1:8000", server.url)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    assert "agent got: hello! you said 'hello?'" in done.stdout
    assert '"status": "finished"' in done.stdout
