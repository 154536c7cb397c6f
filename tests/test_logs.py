"""Log formats: text shows a record's structured fields as key=value; json makes one object
a line with them as keys (and the exception when there is one)."""

from __future__ import annotations

import json
import logging

from disagg.logs import JsonFormatter, TextFormatter


def _record(exc: bool = False) -> logging.LogRecord:
    try:
        if exc:
            raise ValueError("boom")
        info = None
    except ValueError:
        import sys

        info = sys.exc_info()
    record = logging.LogRecord(
        "disagg.access", logging.INFO, __file__, 1, "request %s", ("x",), info
    )
    record.fields = {"request_id": "abc", "status": 200, "duration_ms": 1.5}
    return record


def test_json_lines() -> None:
    line = JsonFormatter().format(_record())
    data = json.loads(line)
    assert data["message"] == "request x" and data["level"] == "info"
    assert (data["request_id"], data["status"], data["duration_ms"]) == ("abc", 200, 1.5)
    assert data["logger"] == "disagg.access" and "\n" not in line
    assert "ValueError: boom" in json.loads(JsonFormatter().format(_record(exc=True)))["exception"]


def test_text_lines() -> None:
    line = TextFormatter().format(_record())
    assert line.endswith("request x request_id=abc status=200 duration_ms=1.5")


def test_http2_preface_is_one_warning() -> None:
    from aiohttp.http_exceptions import BadHttpMessage

    from disagg.logs import Http2Preface

    def record(exc: BaseException) -> logging.LogRecord:
        info = (type(exc), exc, None)
        return logging.LogRecord(
            "aiohttp.server", logging.ERROR, __file__, 1, "Error handling request", (), info
        )

    preface = BadHttpMessage("Pause on PRI/Upgrade:\n\n    b'\\x00\\x00\\x18'")
    f = Http2Preface()
    first = record(preface)
    assert f.filter(first)
    assert first.levelname == "WARNING" and first.exc_info is None
    assert "HTTP/2 preface" in TextFormatter().format(first)
    assert not f.filter(record(preface))  # said once
    other = record(BadHttpMessage("Invalid method"))
    assert f.filter(other) and other.exc_info is not None  # other bad requests untouched
