"""What `make test` (`pytest -n auto --dist loadfile`) does when a worker process dies mid-test.

A worker can die without a Python exception: a segfault inside a native library (seen once in CI:
XLA's CPU compiler, on one test of ~1000 that passes on every other run) or pytest-timeout's thread
method ending a hung test. pytest-xdist 3.8.0 (the newest release) handles that badly under
`--dist loadfile` (its LoadScopeScheduling):

* it puts every file the dead worker had *finished* back on the queue; handed out again they are
  empty work units that never report completion, and the session waits forever at the end
  (pytest-xdist issue #1378: CI sat at 98% for 70 minutes until its time limit killed it);
* a replacement worker handed one unit with one test waits for a second test that never comes
  (as in pytest-xdist #1327);
* it reports the test as failed and then runs it again on the replacement worker, as often as
  workers may be restarted.

`install(config)` patches the controller's scheduler so that finished files are not re-queued, a
worker still collecting is given nothing until its collection arrives, a
late worker is given work until it holds two tests or is told to finish, and a test whose worker
died runs once more on a fresh worker: that second run is the test's verdict (a second death fails
it and it is not run a third time). Each death is listed in the terminal summary with the test it ran, so a
flaky native crash stays visible; it never turns into a pass silently.
"""

from __future__ import annotations

import pytest

#: worker deaths tolerated per test: the first is re-run, the second fails the test
RERUNS_AFTER_A_CRASH = 1

_crashes: dict[str, int] = {}


def _remove_node(self, node):
    """LoadScopeScheduling.remove_node, except that finished units are not re-queued (#1378) and a
    test on which workers died more than RERUNS_AFTER_A_CRASH times is not run again."""
    workload = self.assigned_work.pop(node)
    pending = [(scope, nodeid) for scope, unit in workload.items() for nodeid, done in unit.items() if not done]
    if not pending:
        return None   # a worker that finished its work
    scope, crashed = pending[0]   # a worker runs its units and their tests in the order sent
    _crashes[crashed] = _crashes.get(crashed, 0) + 1
    if _crashes[crashed] > RERUNS_AFTER_A_CRASH:
        workload[scope][crashed] = True
    for scope, unit in workload.items():
        if not all(unit.values()):
            self.workqueue[scope] = unit
    for other in self.assigned_work:
        self._reschedule(other)
    return crashed


def _patch_load_scope_scheduling():
    try:
        from xdist.scheduler.loadscope import LoadScopeScheduling
    except ImportError:   # no xdist: nothing to patch
        return
    if getattr(LoadScopeScheduling, "_jmamba_patched", False):
        return
    needed = ("remove_node", "_reschedule", "_assign_work_unit", "_pending_of")
    if not all(hasattr(LoadScopeScheduling, name) for name in needed):
        raise RuntimeError("tests/xdist_recovery.py was written against pytest-xdist 3.8's "
                           "LoadScopeScheduling; check it against the installed version")
    reschedule = LoadScopeScheduling._reschedule

    def reschedule_until_the_worker_can_run(self, node):
        if node not in self.registered_collections:
            # a replacement worker still collecting: `schedule()` reschedules every node when its
            # collection arrives; handing it work now would index a collection it has not sent
            # (KeyError in `_assign_work_unit`, seen in CI when both workers died close together)
            return
        reschedule(self, node)
        if node.shutting_down:
            return
        # a worker starts a test only once it holds the next one too (or has been told to finish)
        while self.workqueue and self._pending_of(self.assigned_work[node]) < 2:
            self._assign_work_unit(node)
        if not self.workqueue:
            node.shutdown()   # nothing more will come: it runs what it has and stops (#1327)

    LoadScopeScheduling.remove_node = _remove_node
    LoadScopeScheduling._reschedule = reschedule_until_the_worker_can_run
    LoadScopeScheduling._jmamba_patched = True


def install(config):
    """Patch the xdist controller (not the workers) when it schedules by file."""
    if hasattr(config, "workerinput") or not config.pluginmanager.hasplugin("xdist"):
        return
    if getattr(config.option, "dist", "no") not in ("loadfile", "loadscope", "loadgroup"):
        return
    _patch_load_scope_scheduling()


@pytest.hookimpl(optionalhook=True)
def pytest_handlecrashitem(crashitem, report, sched):
    """The first death on a test is reported as a re-run, not a failure (the test runs again)."""
    if _crashes.get(crashitem, 0) <= RERUNS_AFTER_A_CRASH:
        report.outcome = "rerun"


def pytest_report_teststatus(report):
    if report.outcome == "rerun":
        return "rerun", "R", ("RERUN", {"yellow": True})
    return None


def pytest_terminal_summary(terminalreporter):
    if not _crashes:
        return
    terminalreporter.write_sep("=", "worker processes that died")
    for nodeid, n in _crashes.items():
        verdict = "failed" if n > RERUNS_AFTER_A_CRASH else "re-run on a fresh worker (its verdict above)"
        terminalreporter.write_line(f"{nodeid}: worker died {n}x: {verdict}")
