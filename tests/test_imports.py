"""The import contracts of pyproject.toml ([tool.importlinter]): no cycle at any depth of evalkit, no
upward import between its layers or inside the loop package. import-linter builds the graph (grimp),
function-local imports included."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_imports_flow_one_way_with_no_cycle():
    lint = Path(sys.executable).with_name("lint-imports")
    done = subprocess.run([str(lint), "--config", str(ROOT / "pyproject.toml")], cwd=ROOT, capture_output=True,
                          text=True)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "3 kept, 0 broken" in done.stdout
