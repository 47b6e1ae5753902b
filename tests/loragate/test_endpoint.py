"""A running `up`'s endpoint is found only while its instance holds its run directory's lock."""

from __future__ import annotations

from pathlib import Path

from loragate.endpoint import Endpoint, live_endpoints, write_endpoint
from loragate.rundir import run_dir


def test_endpoint_is_live_only_while_its_instance_runs(tmp_path: Path) -> None:
    root = tmp_path / "up"
    with run_dir(root, 8123) as (_, state):
        path = write_endpoint(state, Endpoint("http://127.0.0.1:8123/v1", "sk-dev-1"))
        assert path.stat().st_mode & 0o777 == 0o600
        assert live_endpoints(root) == [Endpoint("http://127.0.0.1:8123/v1", "sk-dev-1")]
    assert live_endpoints(root) == []


def test_a_directory_left_by_a_dead_instance_is_not_live(tmp_path: Path) -> None:
    root = tmp_path / "up"
    state = root / "8124-abcdef"
    state.mkdir(parents=True)
    (state / "instance.lock").touch()  # nobody holds it
    write_endpoint(state, Endpoint("http://127.0.0.1:8124/v1", "sk-dev-2"))
    assert live_endpoints(root) == []
