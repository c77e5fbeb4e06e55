"""A pytest plugin (tests/conftest.py loads it): the conformance table and the rule that at most one harness may be
skipped, where the test reports meet (pytest's own process, or xdist's controller when lanes run the suite).

A conformance test's fixtures attach its measured row or its skipped harness to the test's `user_properties`; those
travel with the report from any lane. Here each row is written to test-output/conformance.json (one writer, however
many lanes) and shown in the terminal summary, and the session fails when more than MAX_SKIPPED_HARNESSES harnesses
were skipped. No Django here, so it loads in any pytest run.
"""
from __future__ import annotations

import pytest

ROW = "conformance_row"
SKIPPED = "conformance_skipped"
MAX_SKIPPED_HARNESSES = 1


def pytest_configure(config) -> None:
    if not hasattr(config, "workerinput"):  # a lane's own reports reach the controller, which records them once
        config.pluginmanager.register(Summary(), "conformance-summary")


class Summary:
    def __init__(self, output=None) -> None:
        self.output = output  # the JSON file of rows (None: tests/conformance/table.OUTPUT, read when first needed)
        self.rows, self.skipped = [], set()

    def _output(self):
        from tests.conformance import table

        return self.output or table.OUTPUT

    @pytest.hookimpl(trylast=True)
    def pytest_runtest_logreport(self, report) -> None:
        if report.when != "teardown":  # the last report of a test carries every property its call added
            return
        for name, value in report.user_properties:
            if name == ROW:
                from tests.conformance import table

                row = table.Row(**value)
                table.record(row, self._output())
                self.rows.append(row)
            elif name == SKIPPED:
                self.skipped.add(value)

    def pytest_terminal_summary(self, terminalreporter) -> None:
        if self.rows:
            from tests.conformance import table

            terminalreporter.write_sep("=", "harness conformance")
            terminalreporter.write_line(table.markdown(self.rows))
            terminalreporter.write_line(f"(all rows measured so far: {self._output()})")

    def pytest_sessionfinish(self, session) -> None:
        """CI fails when more than one harness could not be tested (checked only when harness tests ran)."""
        if len(self.skipped) > MAX_SKIPPED_HARNESSES:
            reporter = session.config.pluginmanager.get_plugin("terminalreporter")
            message = (f"{len(self.skipped)} harnesses skipped ({', '.join(sorted(self.skipped))}); at most "
                       f"{MAX_SKIPPED_HARNESSES} may be: run scripts/install-harnesses")
            if reporter is not None:
                reporter.write_line(f"FAILED: {message}", red=True)
            session.exitstatus = 1
