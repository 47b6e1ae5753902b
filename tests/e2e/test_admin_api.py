"""The admin API on the real stack: auth, worker listing, adapter registry validation, pins, API keys."""

from __future__ import annotations

import os
import time

import httpx
import pytest

from tests.e2e.stack import ADMIN_TOKEN, Stack
from worker.modelzoo.make import ZooPaths

ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


def test_admin_requires_the_admin_token(stack: Stack) -> None:
    assert httpx.get(f"{stack.url}/admin/workers").status_code == 401
    user = httpx.get(f"{stack.url}/admin/workers", headers={"Authorization": "Bearer sk-test-alice"})
    assert user.status_code == 401 and user.json()["error"]["code"] == "invalid_api_key"


def test_workers_report_their_state(stack: Stack) -> None:
    workers = httpx.get(f"{stack.url}/admin/workers", headers=ADMIN).json()["workers"]
    assert {w["worker_id"] for w in workers} == {"w1", "w2"}
    assert all(w["model"] == "tiny" and w["kv_blocks_total"] > 0 and "queue_len" in w for w in workers)


@pytest.mark.parametrize(
    ("base", "name", "path_kind", "status"),
    [
        ("tiny", "ok-adapter", "good", 201),
        ("tiny", "../etc", "good", 404),  # never reaches a handler that could use it
        ("tiny", "bad name!", "good", 400),
        ("tiny", "outside", "outside", 403),
        ("tiny", "traversal", "traversal", 403),
        ("tiny", "symlink-out", "symlink", 403),
        ("tiny", "not-peft", "not_adapter", 400),
    ],
)
def test_adapter_registration_validates_names_and_paths(
    stack: Stack,
    zoo: ZooPaths,
    tmp_path_factory: pytest.TempPathFactory,
    base: str,
    name: str,
    path_kind: str,
    status: int,
) -> None:
    good = zoo.adapter("tiny", "qv-r8")
    root = zoo.root / "adapters"
    if path_kind == "good":
        path = str(good)
    elif path_kind == "outside":
        path = str(zoo.base("tiny"))
    elif path_kind == "traversal":
        path = str(root / "tiny" / ".." / ".." / "tiny")
    elif path_kind == "symlink":
        link = tmp_path_factory.mktemp("links") / "escape"
        os.symlink(zoo.base("tiny"), link)
        path = str(link)
    else:
        path = str(root / "tiny")
    resp = httpx.put(f"{stack.url}/admin/adapters/{base}/{name}", json={"path": path}, headers=ADMIN)
    assert resp.status_code == status, resp.text
    if status >= 400 and resp.status_code != 404:
        # A refusal names what was wrong: the adapter's name, or its path.
        assert resp.json()["error"]["param"] == ("name" if path_kind == "good" else "path"), resp.text


def test_register_list_pin_remove_adapter(stack: Stack, zoo: ZooPaths) -> None:
    url = f"{stack.url}/admin/adapters/tiny/pin-me"
    assert (
        httpx.put(url, json={"path": str(zoo.adapter("tiny", "mlp-r32"))}, headers=ADMIN).status_code == 201
    )
    listed = httpx.get(f"{stack.url}/admin/adapters", headers=ADMIN).json()["adapters"]
    assert any(a["name"] == "pin-me" and a["base"] == "tiny" and not a["pinned"] for a in listed)
    assert httpx.post(f"{url}/pin", json={"pinned": True}, headers=ADMIN).json()["pinned"] is True
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # workers pick the pin up within a heartbeat and load it
        workers = httpx.get(f"{stack.url}/admin/workers", headers=ADMIN).json()["workers"]
        if all("tiny:pin-me" in w["pinned"] and "tiny:pin-me" in w["adapters_host"] for w in workers):
            break
        time.sleep(0.3)
    else:
        raise AssertionError(f"pin not applied: {workers}")
    assert httpx.delete(url, headers=ADMIN).status_code == 204
    assert httpx.delete(url, headers=ADMIN).status_code == 404


def test_api_keys_can_be_issued_used_and_revoked(stack: Stack) -> None:
    created = httpx.post(f"{stack.url}/admin/keys", json={"tenant": "carol"}, headers=ADMIN).json()
    key = created["key"]
    headers = {"Authorization": f"Bearer {key}"}
    assert httpx.get(f"{stack.url}/v1/models", headers=headers).status_code == 200
    listed = httpx.get(f"{stack.url}/admin/keys", headers=ADMIN).json()["keys"]
    assert {"key_id": created["key_id"], "tenant": "carol"} in listed
    assert key not in str(listed)
    assert httpx.delete(f"{stack.url}/admin/keys/{created['key_id']}", headers=ADMIN).status_code == 204
    assert httpx.get(f"{stack.url}/v1/models", headers=headers).status_code == 401
