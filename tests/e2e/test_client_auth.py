"""Client API keys and the admin key: the OpenAI endpoints need a client key when keys are
configured (401 in OpenAI's shape otherwise, and the openai client raises
AuthenticationError); /health stays open; /metrics and /cluster_info need the admin key;
the route header, which names internal workers, goes to the admin only; every answer
carries x-request-id."""

from __future__ import annotations

from pathlib import Path

import httpx
import openai
import pytest

from tests.conftest import Cluster, Procs, assert_no_leaks, start_cluster

CLIENT, OTHER, ADMIN = "sk-client-one", "sk-client-two", "sk-admin-key"
BODY = {"model": "tiny", "prompt": "hello", "max_tokens": 3, "temperature": 0}


@pytest.fixture(scope="module")
def keyed(procs: Procs, tmp_path_factory: pytest.TempPathFactory) -> Cluster:
    tmp = tmp_path_factory.mktemp("keys")
    keys, admin = tmp / "keys.txt", tmp / "admin.txt"
    keys.write_text(f"# client keys\n{CLIENT}\n\n{OTHER}\n")
    admin.write_text(ADMIN + "\n")
    return start_cluster(procs, tmp, 1, 1, api_keys_file=str(keys), admin_key_file=str(admin))


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _admin_view(c: Cluster, path: str) -> None:
    """What assert_no_leaks reads needs the admin key here: check the views directly."""
    assert httpx.get(c.url + path, headers=_auth(ADMIN)).status_code == 200


@pytest.mark.parametrize(
    ("headers", "code"),
    [
        ({}, "missing_api_key"),
        ({"Authorization": "Bearer"}, "missing_api_key"),
        ({"Authorization": "Basic c2s="}, "missing_api_key"),
        (_auth("sk-wrong"), "invalid_api_key"),
        (_auth(CLIENT + "x"), "invalid_api_key"),
    ],
)
def test_without_a_good_key_is_401(keyed: Cluster, headers: dict[str, str], code: str) -> None:
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/responses"):
        r = httpx.post(keyed.url + path, json=BODY, headers=headers)
        assert r.status_code == 401, r.text
        err = r.json()["error"]
        assert (err["type"], err["code"]) == ("authentication_error", code)
        assert CLIENT not in r.text and "sk-wrong" not in r.text
    assert httpx.get(keyed.url + "/v1/models", headers=headers).status_code == 401


def test_each_client_key_works_and_health_stays_open(keyed: Cluster) -> None:
    assert httpx.get(keyed.url + "/health").status_code == 200
    for key in (CLIENT, OTHER, ADMIN):
        r = httpx.post(keyed.url + "/v1/completions", json=BODY, headers=_auth(key))
        assert r.status_code == 200, r.text
    r = httpx.post(keyed.url + "/v1/completions", json=BODY, headers={"x-api-key": CLIENT})
    assert r.status_code == 200


def test_the_openai_client(keyed: Cluster) -> None:
    good = openai.OpenAI(base_url=keyed.url + "/v1", api_key=CLIENT, max_retries=0)
    out = good.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=3
    )
    assert out.choices[0].message.content is not None
    assert [m.id for m in good.models.list()] == ["tiny"]
    bad = openai.OpenAI(base_url=keyed.url + "/v1", api_key="sk-nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model="tiny", prompt="hi", max_tokens=2)


def test_operator_views_need_the_admin_key(keyed: Cluster) -> None:
    for path in ("/metrics", "/cluster_info"):
        assert httpx.get(keyed.url + path).status_code == 401
        assert httpx.get(keyed.url + path, headers=_auth(CLIENT)).status_code == 401
        _admin_view(keyed, path)


def test_route_header_only_for_the_admin_and_request_ids(keyed: Cluster) -> None:
    r = httpx.post(keyed.url + "/v1/completions", json=BODY, headers=_auth(CLIENT))
    assert "x-disagg-route" not in r.headers
    assert len(r.headers["x-request-id"]) == 32  # generated
    headers = {**_auth(ADMIN), "x-request-id": "trace-me-42"}
    r = httpx.post(keyed.url + "/v1/completions", json={**BODY, "stream": True}, headers=headers)
    assert r.status_code == 200
    assert r.headers["x-request-id"] == "trace-me-42"
    assert "context=" in r.headers["x-disagg-route"]
    r = httpx.post(keyed.url + "/v1/completions", json=BODY)
    assert r.status_code == 401 and r.headers["x-request-id"]


def test_keys_from_the_environment(
    procs: Procs, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DISAGG_API_KEYS", "sk-env-a, sk-env-b")
    monkeypatch.setenv("DISAGG_ADMIN_KEY", "sk-env-admin")
    c = start_cluster(procs, tmp_path, 1, 1)
    assert httpx.post(c.url + "/v1/completions", json=BODY).status_code == 401
    r = httpx.post(c.url + "/v1/completions", json=BODY, headers=_auth("sk-env-b"))
    assert r.status_code == 200
    assert httpx.get(c.url + "/metrics", headers=_auth("sk-env-admin")).status_code == 200


def test_no_keys_configured_means_open(cluster: Cluster) -> None:
    r = httpx.post(cluster.url + "/v1/completions", json=BODY)
    assert r.status_code == 200 and "x-disagg-route" in r.headers
    assert_no_leaks(cluster)
