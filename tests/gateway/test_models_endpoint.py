"""`GET /v1/models` and `GET /v1/models/{model}` on a real gateway (uvicorn on 127.0.0.1, real Redis): a
key sees `auto`, the base models served now and the adapters its tenant may use; one model is the same
object as in the list; another tenant's private adapter, or a name never served, is 404 for it."""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import pytest
import redis

from loragate import contracts
from loragate.messages import AdapterRecord, WorkerState
from tests.gateway.live_gateway import live_gateway

ALICE, BOB = {"Authorization": "Bearer sk-test-alice"}, {"Authorization": "Bearer sk-test-bob"}
SHARED = AdapterRecord("models-shared", "models-base", "/adapters/shared")
BOBS = AdapterRecord("models-bobs", "models-base", "/adapters/bobs", tenants=("bob",))
ORG_MODEL = "models-org/base-7b"  # a --model-name with a "/", as Hugging Face names are


@pytest.fixture
def gateway(redis_url: str) -> Iterator[str]:
    r = redis.Redis.from_url(redis_url)
    state = WorkerState("models-w1", "models-base", "/m", 2048, updated_at=time.time())
    org = WorkerState("models-w2", ORG_MODEL, "/m", 2048, updated_at=time.time())
    for s in (state, org):
        r.set(contracts.worker_state(s.model, s.worker_id), s.to_json(), ex=60)
    for rec in (SHARED, BOBS):
        r.hset(contracts.ADAPTERS, rec.key, rec.to_json())
    try:
        with live_gateway(redis_url) as url:
            deadline = time.monotonic() + 10
            while not {"models-base", ORG_MODEL} <= ids(
                url, ALICE
            ):  # the fleet view refreshes every half second
                assert time.monotonic() < deadline
                time.sleep(0.1)
            yield url
    finally:
        r.delete(
            contracts.worker_state(state.model, state.worker_id),
            contracts.worker_state(org.model, org.worker_id),
        )
        r.hdel(contracts.ADAPTERS, SHARED.key, BOBS.key)
        r.close()


def ids(url: str, headers: dict[str, str]) -> set[str]:
    listed = httpx.get(f"{url}/v1/models", headers=headers, timeout=10).json()["data"]
    return {m["id"] for m in listed}


def test_each_key_lists_only_what_its_tenant_may_use(gateway: str) -> None:
    assert {"auto", "models-base", SHARED.key} <= ids(gateway, ALICE)
    assert BOBS.key not in ids(gateway, ALICE)
    assert BOBS.key in ids(gateway, BOB)


@pytest.mark.parametrize("model", ["auto", "models-base", SHARED.key, ORG_MODEL])
def test_one_model_is_the_object_the_list_has(gateway: str, model: str) -> None:
    listed = httpx.get(f"{gateway}/v1/models", headers=ALICE, timeout=10).json()["data"]
    got = httpx.get(f"{gateway}/v1/models/{model}", headers=ALICE, timeout=10)
    assert got.status_code == 200
    expected = next(m for m in listed if m["id"] == model)
    assert {k: v for k, v in got.json().items() if k != "created"} == {
        k: v for k, v in expected.items() if k != "created"
    }


@pytest.mark.parametrize(
    ("model", "headers", "status"),
    [
        pytest.param(BOBS.key, ALICE, 404, id="another tenant's adapter"),
        pytest.param("never-served", ALICE, 404, id="unknown name"),
        pytest.param("never/served", ALICE, 404, id="unknown name with a slash"),
        pytest.param("models-base", {}, 401, id="no key"),
    ],
)
def test_what_a_key_may_not_see_is_refused(
    gateway: str, model: str, headers: dict[str, str], status: int
) -> None:
    got = httpx.get(f"{gateway}/v1/models/{model}", headers=headers, timeout=10)
    assert got.status_code == status
    error = got.json()["error"]
    if status == 404:
        assert (error["code"], error["param"]) == ("model_not_found", "model")
    assert httpx.get(f"{gateway}/v1/models/{BOBS.key}", headers=BOB, timeout=10).status_code == 200
