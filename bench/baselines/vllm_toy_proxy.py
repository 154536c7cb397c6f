"""Benchmark baseline: the design of vLLM's toy disaggregated proxy, rebuilt as a small script.
A FastAPI app with one shared httpx.AsyncClient sends each completion to a prefill server with
max_tokens=1 and kv_transfer_params.do_remote_decode, then the original request plus the
kv_transfer_params it got back to a decode server, and relays that answer. Round robin only:
no health checks, retries or load awareness, on purpose. Runs with the peers' python.
"""

import argparse
import itertools
import uuid
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

import httpx
import uvicorn  # type: ignore[import-not-found,unused-ignore]
from fastapi import FastAPI, Request  # type: ignore[import-not-found,unused-ignore]
from fastapi.responses import (  # type: ignore[import-not-found,unused-ignore]
    JSONResponse,
    Response,
    StreamingResponse,
)
from starlette.background import BackgroundTask  # type: ignore[import-not-found,unused-ignore]

# What the prefill leg asks for: keep the KV for a remote decode, which will pull it.
REMOTE_DECODE: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


class RoundRobin:
    """Hands out base URLs in turn."""

    def __init__(self, urls: Sequence[str]) -> None:
        if not urls:
            raise ValueError("need at least one URL")
        self.urls = tuple(u.rstrip("/") for u in urls)
        self._turn = itertools.cycle(self.urls)

    def pick(self) -> str:
        return next(self._turn)


def _error(status: int, message: str) -> Any:
    body = {"error": {"message": message, "type": "proxy_error", "param": None, "code": status}}
    return JSONResponse(body, status_code=status)


def _relayed(r: httpx.Response, content: bytes) -> Any:
    media = r.headers.get("content-type", "application/json")
    return Response(content=content, status_code=r.status_code, media_type=media)


class ToyProxy:
    """Prefill leg, then decode leg, for /v1/completions and /v1/chat/completions."""

    def __init__(
        self, prefill: Sequence[str], decode: Sequence[str], max_connections: int | None
    ) -> None:
        self.prefill, self.decode = RoundRobin(prefill), RoundRobin(decode)
        self.limits = httpx.Limits(max_connections=max_connections)
        self._client: httpx.AsyncClient | None = None

    @property
    def client(self) -> httpx.AsyncClient:
        if self._client is None:
            raise RuntimeError("the proxy's client is opened by the app's lifespan")
        return self._client

    @asynccontextmanager
    async def lifespan(self, _app: Any) -> AsyncIterator[None]:
        async with httpx.AsyncClient(timeout=None, limits=self.limits) as client:
            self._client = client
            try:
                yield
            finally:
                self._client = None

    def app(self) -> Any:
        app = FastAPI(lifespan=self.lifespan)
        app.add_api_route("/v1/completions", self.completions, methods=["POST"])
        app.add_api_route("/v1/chat/completions", self.chat_completions, methods=["POST"])
        app.add_api_route("/v1/models", self.models, methods=["GET"])
        app.add_api_route("/health", self.health, methods=["GET"])
        return app

    async def health(self) -> Any:
        n_prefill, n_decode = len(self.prefill.urls), len(self.decode.urls)
        return {"status": "ok", "prefill_instances": n_prefill, "decode_instances": n_decode}

    async def models(self) -> Any:
        try:
            r = await self.client.get(self.decode.pick() + "/v1/models")
        except httpx.HTTPError as exc:
            return _error(502, f"decode server unreachable: {exc!r}")
        return _relayed(r, r.content)

    async def completions(self, request: Request) -> Any:
        return await self._disaggregated(request, "/v1/completions", chat=False)

    async def chat_completions(self, request: Request) -> Any:
        return await self._disaggregated(request, "/v1/chat/completions", chat=True)

    async def _disaggregated(self, request: Any, path: str, *, chat: bool) -> Any:
        try:
            body = await request.json()
        except ValueError:
            return _error(400, "the body is not JSON")
        if not isinstance(body, dict):
            return _error(400, "the body must be a JSON object")
        headers = {"X-Request-Id": uuid.uuid4().hex}  # one id for both legs, as vLLM does
        try:
            answer = await self._prefill(path, body, headers, chat=chat)
            if not isinstance(answer, dict):
                return answer  # the prefill server's error, relayed
            params = answer.get("kv_transfer_params")
            if params:
                body = {**body, "kv_transfer_params": params}
            return await self._decode(path, body, headers)
        except httpx.HTTPError as exc:
            return _error(502, f"upstream failed: {exc!r}")

    async def _prefill(
        self, path: str, body: dict[str, Any], headers: dict[str, str], *, chat: bool
    ) -> Any:
        leg = {**body, "max_tokens": 1, "stream": False, "kv_transfer_params": REMOTE_DECODE}
        if chat or "max_completion_tokens" in body:
            leg["max_completion_tokens"] = 1
        leg.pop("stream_options", None)
        r = await self.client.post(self.prefill.pick() + path, json=leg, headers=headers)
        if r.status_code >= 400:
            return _relayed(r, r.content)
        answer = r.json()
        return answer if isinstance(answer, dict) else {}

    async def _decode(self, path: str, body: dict[str, Any], headers: dict[str, str]) -> Any:
        url = self.decode.pick() + path
        req = self.client.build_request("POST", url, json=body, headers=headers)
        r = await self.client.send(req, stream=True)
        if not body.get("stream") or r.status_code >= 400:
            try:
                content = await r.aread()
            finally:
                await r.aclose()
            return _relayed(r, content)
        media = r.headers.get("content-type", "text/event-stream")
        return StreamingResponse(
            r.aiter_bytes(),
            status_code=r.status_code,
            media_type=media,
            background=BackgroundTask(r.aclose),  # runs on a client disconnect too
        )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prefill", nargs="+", action="extend", required=True, metavar="URL")
    p.add_argument("--decode", nargs="+", action="extend", required=True, metavar="URL")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--max-connections",
        type=int,
        default=100,
        help="the shared client's connection pool (httpx's default: 100); 0: no limit",
    )
    p.add_argument("--log-level", default="warning", choices=["debug", "info", "warning"])
    return p


def main(argv: Sequence[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    limit = args.max_connections if args.max_connections > 0 else None
    proxy = ToyProxy(args.prefill, args.decode, limit)
    uvicorn.run(
        proxy.app(), host=args.host, port=args.port, log_level=args.log_level, access_log=False
    )


if __name__ == "__main__":
    main()
