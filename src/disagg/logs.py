"""Log lines for people and for log pipelines: `text` (one readable line) or `json` (one JSON
object a line, for Loki, Elasticsearch and the like). A record may carry structured fields
(`extra={"fields": {...}}`): the request line does, with the request id; text shows them as
`key=value`, JSON as keys. Formatting only: what to log is decided where it happens.
"""

from __future__ import annotations

import json
import logging
import sys
from typing import Any

FORMATS = ("text", "json")
_TEXT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def _fields(record: logging.LogRecord) -> dict[str, Any]:
    fields = getattr(record, "fields", None)
    return fields if isinstance(fields, dict) else {}


class TextFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__(_TEXT)

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        extra = " ".join(f"{k}={v}" for k, v in _fields(record).items())
        return f"{line} {extra}" if extra else line


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": round(record.created, 6),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
            **_fields(record),
        }
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str, separators=(",", ":"))


class Http2Preface(logging.Filter):
    """A client that opens with HTTP/2's preface (prior knowledge: sglang-router's probes,
    gRPC tools) gets a 400 from these HTTP/1.1 servers, and aiohttp logs a traceback with
    the binary frames for each connection. One warning a process instead."""

    MESSAGE = (
        "a client opened with the HTTP/2 preface (HTTP/2 prior knowledge); this server"
        " speaks HTTP/1.1 and answered 400 (said once; later ones are not logged)"
    )

    def __init__(self) -> None:
        super().__init__()
        self.said = False

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if exc is None or "PRI/Upgrade" not in str(exc):
            return True
        if self.said:
            return False
        self.said = True
        record.msg, record.args, record.exc_info, record.exc_text = self.MESSAGE, (), None, None
        record.levelno, record.levelname = logging.WARNING, "WARNING"
        return True


_PREFACE = Http2Preface()


def configure(level: str, fmt: str = "text") -> None:
    """Log to stderr at `level` in format `fmt` (see FORMATS)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    server = logging.getLogger("aiohttp.server")
    if _PREFACE not in server.filters:
        server.addFilter(_PREFACE)
