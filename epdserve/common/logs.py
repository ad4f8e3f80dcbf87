"""How a process logs: text or JSON lines on stderr. In ``common`` because the engine's core
process sets it up too, and the engine sits below the HTTP front end (``api/logs.py``: access and
stats lines, request ids)."""

from __future__ import annotations

import json
import logging
import time
from typing import Any, Literal

LogFormat = Literal["text", "json"]
LOG_FORMAT_ENV = "EPD_LOG_FORMAT"  # how a role's engine core process logs (set by the role)


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "time": self.formatTime(record, "%Y-%m-%dT%H:%M:%S") + f".{int(record.msecs):03d}",
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        out.update(getattr(record, "fields", {}))
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


class TextFormatter(logging.Formatter):
    """logging's text lines, the time formatted once a second rather than for every record (a
    router writes an access line per request, and ``time.strftime`` was a measurable part of it)."""

    def __init__(self, fmt: str) -> None:
        super().__init__(fmt)
        self._second, self._text = -1, ""

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:
        if datefmt is not None:
            return super().formatTime(record, datefmt)
        second = int(record.created)
        if second != self._second:
            self._second, self._text = second, time.strftime(self.default_time_format, self.converter(second))
        return f"{self._text},{int(record.msecs):03d}"


ACCESS_LOGGER = "epdserve.access"  # one line per request (``api/logs.py``)


def setup(fmt: LogFormat = "text", prefix: str = "", access: bool = True) -> None:
    """Configure the process's logging (``prefix`` marks a sub-process, e.g. "[core] "; without
    ``access``, no access lines). Records do not look up their thread and process, which no line
    prints."""
    logging.logThreads = logging.logProcesses = logging.logMultiprocessing = False
    handler = logging.StreamHandler()
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(TextFormatter(f"%(asctime)s %(levelname)s {prefix}%(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.INFO)
    logging.getLogger(ACCESS_LOGGER).setLevel(logging.INFO if access else logging.WARNING)
