"""The repository's skip policy (conftest.py) under GLMSERVE_STRICT_SKIPS=1, as CI runs it: a skip fails,
except a `cpu_feature` skip where the CPU lacks the feature."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

CASES = '''
import pytest

def test_missing_dependency():
    pytest.skip("redis-server missing")

@pytest.mark.cpu_feature(False, feature="bfloat16 instructions")
def test_path_this_cpu_lacks():
    raise AssertionError("must not run")

@pytest.mark.cpu_feature(True, feature="bfloat16 instructions")
def test_path_this_cpu_has():
    pass
'''


def test_a_skip_fails_unless_the_cpu_lacks_the_feature(tmp_path: Path) -> None:
    shutil.copy(REPO / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "test_cases.py").write_text(CASES)
    env = {**os.environ, "GLMSERVE_STRICT_SKIPS": "1"}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", "-W",
                          "ignore::pytest.PytestUnknownMarkWarning", "test_cases.py"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert "FAILED test_cases.py::test_missing_dependency" in run.stdout, run.stdout
    assert "this CPU lacks bfloat16 instructions" in run.stdout
    assert "PASSED test_cases.py::test_path_this_cpu_has" in run.stdout
    assert "1 failed, 1 passed, 1 skipped" in run.stdout
