"""Repository-wide pytest policy: with ``GLMSERVE_STRICT_SKIPS=1`` (set by ``.ci/run``) a skipped test
fails, naming its skip reason. Tests skip when a dependency is missing (redis-server, promtool, helm,
the bundled model, NIXL); on CI the install step provides all of them, so a skip there is a broken
install, not a pass. The one exception is the ``cpu_feature(available, feature=...)`` marker: a test of
a path only CPUs with that feature take (bfloat16 instructions) skips where the CPU lacks it, and that
skip passes: no install can add the feature."""

from __future__ import annotations

import os

import pytest

# Every engine the tests start, in this process or in the workers it launches, runs float32 unless a
# test names another dtype: the oracles (transformers, greedy runs, logprob tables) are float32, and
# `auto` would be bfloat16 on CPUs with bf16 instructions (glmserve/model/dtype_choice.py).
os.environ.setdefault("GLMSERVE_DTYPE", "float32")


def _strict() -> bool:
    return os.environ.get("GLMSERVE_STRICT_SKIPS") == "1"


def _fail_skip(report: pytest.TestReport | pytest.CollectReport) -> None:
    if not (_strict() and report.skipped and not hasattr(report, "wasxfail")):
        return
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    report.outcome = "failed"
    report.longrepr = f"skipped, which fails under GLMSERVE_STRICT_SKIPS=1: {reason}"


_LACKS_FEATURE = pytest.StashKey[bool]()


def pytest_runtest_setup(item: pytest.Item) -> None:
    marker = item.get_closest_marker("cpu_feature")
    if marker is not None and not marker.args[0]:
        item.stash[_LACKS_FEATURE] = True
        pytest.skip(f"this CPU lacks {marker.kwargs['feature']}")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> object:
    outcome = yield
    if not item.stash.get(_LACKS_FEATURE, False):
        _fail_skip(outcome.get_result())


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> object:
    outcome = yield
    _fail_skip(outcome.get_result())
