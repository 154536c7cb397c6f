"""The orchestrator's OpenAPI 3.1 document (`GET /openapi.json`), built from the msgspec
request types the frontend validates with, so the schema is the code. It lists the client
endpoints and the operator views with the error shape every failure uses. Pure data.
"""

from __future__ import annotations

from functools import cache
from typing import Any

import msgspec

from disagg import __version__
from disagg.protocol import ChatCompletionRequest, CompletionRequest, ResponsesRequest

_REF = "#/components/schemas/{name}"
_ERRORS = {
    "400": "the request is malformed or over a limit (`param` names the field)",
    "401": "missing or wrong API key",
    "404": "unknown model",
    "408": "the body did not arrive in time",
    "413": "the body is too large",
    "429": "the server is full (see Retry-After)",
    "502": "a worker failed",
    "503": "no worker can take the request now",
    "504": "the request ran past its deadline",
}


def _json(ref: str) -> dict[str, Any]:
    return {"application/json": {"schema": {"$ref": _REF.format(name=ref)}}}


def _answers(ok: str, streams: bool) -> dict[str, Any]:
    content: dict[str, Any] = {"application/json": {"schema": {"type": "object"}}}
    if streams:
        content["text/event-stream"] = {"schema": {"type": "string"}}
    out: dict[str, Any] = {"200": {"description": ok, "content": content}}
    for status, why in _ERRORS.items():
        out[status] = {"description": why, "content": _json("Error")}
    return out


def _post(kind: str, summary: str) -> dict[str, Any]:
    return {
        "post": {
            "summary": summary,
            "requestBody": {"required": True, "content": _json(kind)},
            "responses": _answers("the answer, or its stream when `stream` is true", True),
            "security": [{"apiKey": []}, {}],
        }
    }


def _get(summary: str, admin: bool = False) -> dict[str, Any]:
    op: dict[str, Any] = {"summary": summary, "responses": _answers(summary, False)}
    op["security"] = [{"apiKey": []}, {}]
    if admin:
        op["description"] = "Needs the admin key when one is configured."
    return {"get": op}


@cache
def document() -> dict[str, Any]:
    _, components = msgspec.json.schema_components(
        [CompletionRequest, ChatCompletionRequest, ResponsesRequest], ref_template=_REF
    )
    components["Error"] = {
        "type": "object",
        "required": ["error"],
        "properties": {
            "error": {
                "type": "object",
                "required": ["message", "type"],
                "properties": {
                    "message": {"type": "string"},
                    "type": {"type": "string"},
                    "param": {"type": ["string", "null"]},
                    "code": {},
                },
            }
        },
    }
    return {
        "openapi": "3.1.0",
        "info": {"title": "disagg orchestrator", "version": __version__},
        "paths": {
            "/v1/completions": _post("CompletionRequest", "Completions"),
            "/v1/chat/completions": _post("ChatCompletionRequest", "Chat completions"),
            "/v1/responses": _post("ResponsesRequest", "Responses"),
            "/v1/models": _get("The models the ready workers serve"),
            "/health": {
                "get": {
                    "summary": "Readiness",
                    "responses": {
                        "200": {"description": "ready"},
                        "503": {"description": "not ready"},
                    },
                }
            },
            "/cluster_info": _get("Workers, admission and the prefix index", admin=True),
        },
        "components": {
            "schemas": components,
            "securitySchemes": {"apiKey": {"type": "http", "scheme": "bearer"}},
        },
    }
