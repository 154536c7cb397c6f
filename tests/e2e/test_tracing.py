"""OpenTelemetry, end to end: with `otlp_config`, the orchestrator exports one SERVER span per
client request (a child of the client's trace when it sent `traceparent`) and a CLIENT child
span per leg, and each leg carries its span's trace context to its worker."""

from __future__ import annotations

from pathlib import Path

import httpx
import openai

from tests.conftest import Procs, Proxy, start_cluster, start_workers
from tests.otlp_receiver import OtlpReceiver

CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"


def test_request_and_leg_spans(procs: Procs, tmp_path: Path) -> None:
    urls = start_workers(procs, "context", "generation")
    proxies = Proxy(urls[0]), Proxy(urls[1])
    with OtlpReceiver() as receiver, proxies[0] as ctx, proxies[1] as gen:
        c = start_cluster(
            procs,
            tmp_path,
            0,
            0,
            extra_ctx=[ctx],
            extra_gen=[gen],
            otlp_config={"otlp_traces_endpoint": receiver.url},
        )
        body = {"model": "tiny", "prompt": "trace me", "max_tokens": 4}
        traceparent = f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"
        r = httpx.post(c.url + "/v1/completions", json=body, headers={"traceparent": traceparent})
        assert r.status_code == 200
        client = openai.OpenAI(base_url=c.url + "/v1", api_key="none", max_retries=0)
        chunks = list(
            client.completions.create(model="tiny", prompt="x", max_tokens=4, stream=True)
        )
        assert chunks
        bad = httpx.post(c.url + "/v1/completions", json={**body, "max_tokens": -1})
        assert bad.status_code == 400
        spans = receiver.wait_for(7, timeout=20)  # 3 requests, 4 legs

    requests = [s for s in spans if s["kind"] == "server"]
    legs = [s for s in spans if s["kind"] == "client"]
    assert len(requests) == 3 and len(legs) == 4
    traced = next(s for s in requests if s["trace_id"] == CLIENT_TRACE)
    assert traced["parent_span_id"] == CLIENT_SPAN
    assert traced["attributes"]["disagg.endpoint"] == "completions"
    assert traced["attributes"]["http.response.status_code"] == 200
    refused = next(s for s in requests if s["attributes"].get("http.response.status_code") == 400)
    assert refused["status_code"] != "error"  # the client's mistake is no server error
    for request in (s for s in requests if s is not refused):
        children = [s for s in legs if s["parent_span_id"] == request["span_id"]]
        assert sorted(s["name"] for s in children) == ["context_leg", "generation_leg"]
        assert all(s["trace_id"] == request["trace_id"] for s in children)
    # Each worker got its leg's span as the parent of whatever it traces.
    leg_ids = {(s["trace_id"], s["span_id"]) for s in legs}
    for proxy in proxies:
        sent = [h["traceparent"] for path, h in proxy.seen if path == "/v1/completions"]
        assert len(sent) == 2
        for header in sent:
            _, trace_id, parent_id, _ = header.split("-")
            assert (trace_id, parent_id) in leg_ids
