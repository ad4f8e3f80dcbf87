"""How a process's log lines look: the text formatter writes what logging's own would."""

from __future__ import annotations

import logging

import pytest

from epdserve.common.logs import ACCESS_LOGGER, TextFormatter, setup

FORMAT = "%(asctime)s %(levelname)s [core] %(name)s: %(message)s"


@pytest.mark.parametrize("created", [1e9, 1e9 + 0.0004, 1e9 + 0.9996, 1e9 + 1.5, 1e9 + 1.0, 1e9 + 86400.25, 1e9])
def test_text_lines_are_logging_s_own_across_seconds(created: float) -> None:
    ours, theirs = TEXT, logging.Formatter(FORMAT)
    record = logging.LogRecord("epdserve.access", logging.INFO, __file__, 1, "id=%s status=%d", ("ab", 200), None)
    record.created, record.msecs = created, int((created - int(created)) * 1000)
    assert ours.format(record) == theirs.format(record)


TEXT = TextFormatter(FORMAT)  # one formatter across the cases: its cached second must not leak into the next


def test_without_access_lines_a_role_still_logs_everything_else() -> None:
    root = logging.getLogger()
    saved = (root.handlers[:], root.level, logging.getLogger(ACCESS_LOGGER).level)
    try:
        setup(access=False)
        assert not logging.getLogger(ACCESS_LOGGER).isEnabledFor(logging.INFO)
        assert logging.getLogger("epdserve.router.app").isEnabledFor(logging.INFO)
        assert logging.getLogger(ACCESS_LOGGER).isEnabledFor(logging.WARNING)
        setup()
        assert logging.getLogger(ACCESS_LOGGER).isEnabledFor(logging.INFO)
    finally:
        root.handlers[:], root.level = saved[0], saved[1]
        logging.getLogger(ACCESS_LOGGER).setLevel(saved[2])
