"""How a process's log lines look: the text formatter writes what logging's own would."""

from __future__ import annotations

import logging

import pytest

from epdserve.common.logs import TextFormatter

FORMAT = "%(asctime)s %(levelname)s [core] %(name)s: %(message)s"


@pytest.mark.parametrize("created", [1e9, 1e9 + 0.0004, 1e9 + 0.9996, 1e9 + 1.5, 1e9 + 1.0, 1e9 + 86400.25, 1e9])
def test_text_lines_are_logging_s_own_across_seconds(created: float) -> None:
    ours, theirs = TEXT, logging.Formatter(FORMAT)
    record = logging.LogRecord("epdserve.access", logging.INFO, __file__, 1, "id=%s status=%d", ("ab", 200), None)
    record.created, record.msecs = created, int((created - int(created)) * 1000)
    assert ours.format(record) == theirs.format(record)


TEXT = TextFormatter(FORMAT)  # one formatter across the cases: its cached second must not leak into the next
