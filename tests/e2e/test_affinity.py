"""Conversation affinity end to end: the turns of one conversation (the OpenAI `user` field
or the x-disagg-conversation-id header) stay on the same context and generation workers."""

from __future__ import annotations

from pathlib import Path

import openai

from tests.conftest import Procs, assert_no_leaks, route_of, start_cluster


def test_conversation_stays_on_its_workers(procs: Procs, tmp_path: Path) -> None:
    c = start_cluster(procs, tmp_path, 2, 2, router={"type": "conversation"})
    client = openai.OpenAI(base_url=c.url + "/v1")
    routes = {}
    for who in ("alice", "bob"):
        seen = set()
        for turn in range(4):
            raw = client.chat.completions.with_raw_response.create(
                model="tiny",
                messages=[{"role": "user", "content": f"turn {turn}"}],
                max_tokens=3,
                user=who,
            )
            route = route_of(raw)
            seen.add((route["context"], route["generation"]))
        assert len(seen) == 1, seen  # every turn on the same pair
        routes[who] = seen.pop()
    assert routes["alice"] != routes["bob"]  # two idle pairs: the conversations spread
    raw = client.chat.completions.with_raw_response.create(
        model="tiny",
        messages=[{"role": "user", "content": "by header"}],
        max_tokens=3,
        extra_headers={"x-disagg-conversation-id": "alice"},
    )
    assert (route_of(raw)["context"], route_of(raw)["generation"]) == routes["alice"]
    assert_no_leaks(c)
