"""The control API on real hypercorn: the token file, refusals without the token, status,
event paging and streaming, metrics, actions, the loopback rule, and the CLI's client."""

from __future__ import annotations

import functools
import os
import socket
import stat

import httpx
import orjson
import pytest
import trio

from engy_node.control import (
    STREAM_POLL_S,
    Actions,
    ControlAuthError,
    ControlEndpoint,
    NodeNotRunningError,
    control_token,
    endpoint_path,
    fetch_status,
    loopback_bind,
    read_endpoint,
    read_token,
    serve_control,
    token_path,
)
from engy_node.errors import ConfigError
from engy_node.hub import Hub
from tests.waiting import logged

RING = 8
NODE_INFO = {"version": "0.0-test", "pid": 4242, "roles": ["miner"], "started_at": 1700000000.0, "home": "/tmp/home"}
TIMEOUT_S = 10


class Node:
    def __init__(self, hub: Hub, actions: Actions, endpoint: ControlEndpoint, data_dir) -> None:
        self.hub = hub
        self.actions = actions
        self.endpoint = endpoint
        self.data_dir = data_dir
        self.token = token_path(data_dir).read_text().strip()
        # trust_env=False, as the CLI's client: an environment proxy must not see the token.
        self.client = httpx.AsyncClient(
            base_url=endpoint.url, timeout=TIMEOUT_S, trust_env=False, headers={"authorization": f"Bearer {self.token}"}
        )
        self.anonymous = httpx.AsyncClient(base_url=endpoint.url, timeout=TIMEOUT_S, trust_env=False)


@pytest.fixture
async def node(nursery, tmp_path):
    hub = Hub(ring_size=RING)
    actions = Actions()
    data_dir = tmp_path / "data"
    endpoint = await nursery.start(
        functools.partial(serve_control, hub, data_dir=data_dir, actions=actions, node_info=NODE_INFO)
    )
    node = Node(hub, actions, endpoint, data_dir)
    yield node
    await node.client.aclose()
    await node.anonymous.aclose()


def error_of(response: httpx.Response) -> dict:
    assert response.headers["content-type"] == "application/json"
    return response.json()["error"]


# ---- the token file --------------------------------------------------------------------------
def test_the_token_is_made_once_with_mode_0600_and_reused(tmp_path):
    data_dir = tmp_path / "data"
    token = control_token(data_dir)
    path = token_path(data_dir)
    assert path == data_dir / "control.token"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert len(token) >= 43 and path.read_text().strip() == token
    assert control_token(data_dir) == token, "a restart keeps the token, so attached clients keep working"
    assert read_token(path) == token
    assert [p.name for p in data_dir.iterdir()] == ["control.token"], "no temporary file is left behind"


def test_a_token_file_others_could_read_is_replaced_by_a_fresh_private_one(tmp_path):
    token = control_token(tmp_path)
    os.chmod(token_path(tmp_path), 0o644)
    with logged("engy.control", "readable by others") as warning:
        fresh = control_token(tmp_path)
    assert warning.message is not None
    assert fresh != token, "a token that may have been read is not kept"
    assert stat.S_IMODE(token_path(tmp_path).stat().st_mode) == 0o600
    assert control_token(tmp_path) == fresh


def test_an_empty_token_file_is_replaced_and_an_unusable_one_refused(tmp_path):
    path = token_path(tmp_path)
    path.write_text("")
    os.chmod(path, 0o600)
    assert len(control_token(tmp_path)) >= 43
    path.write_text("two words\n")
    with pytest.raises(ConfigError, match="delete the file"):
        control_token(tmp_path)


def test_a_client_never_makes_a_token(tmp_path):
    with pytest.raises(NodeNotRunningError, match="no control token at"):
        read_token(token_path(tmp_path))
    assert not token_path(tmp_path).exists()
    with pytest.raises(NodeNotRunningError, match="no engy node is serving"):
        read_endpoint(tmp_path)


# ---- refusals --------------------------------------------------------------------------------
@pytest.mark.parametrize("headers", [{}, {"authorization": "Bearer not-the-token"}, {"authorization": "Basic abc"}])
async def test_every_request_without_the_token_is_refused_with_json_naming_the_token_file(node, headers):
    for path in ("/v1/status", "/metrics", "/v1/events/stream", "/no/such/path"):
        response = await node.anonymous.get(path, headers=headers)
        assert response.status_code == 401, path
        error = error_of(response)
        assert error["type"] == "unauthorized"
        assert str(token_path(node.data_dir)) in error["message"]
        assert response.headers["www-authenticate"] == "Bearer"
    posted = await node.anonymous.post("/v1/actions/anything", headers=headers)
    assert posted.status_code == 401


async def test_the_bearer_scheme_is_case_insensitive(node):
    response = await node.anonymous.get("/v1/status", headers={"authorization": f"bearer {node.token}"})
    assert response.status_code == 200


async def test_unknown_paths_and_methods_answer_json(node):
    missing = await node.client.get("/v2/status")
    assert missing.status_code == 404 and error_of(missing)["type"] == "not_found"
    wrong_method = await node.client.delete("/v1/status")
    assert wrong_method.status_code == 405 and error_of(wrong_method)["type"] == "method_not_allowed"


# ---- status ----------------------------------------------------------------------------------
async def test_status_has_the_node_info_and_the_hub_snapshot(node):
    node.hub.set_state("miner", model="smollm2-135m", max_inflight=2, plan=str(node.data_dir))
    node.hub.registry.gauge("engy_test_inflight", "requests in flight").set(3)
    node.hub.emit("info", "miner", "hello")
    body = (await node.client.get("/v1/status")).json()
    assert body["node"] == NODE_INFO
    assert body["states"]["miner"] == {"model": "smollm2-135m", "max_inflight": 2, "plan": str(node.data_dir)}
    assert body["states"]["control"] == {"url": node.endpoint.url, "token_file": str(token_path(node.data_dir))}
    assert body["metrics"]["engy_test_inflight"]["children"][0]["value"] == 3
    assert body["last_seq"] == node.hub.snapshot()["last_seq"] >= 0
    assert node.token not in orjson.dumps(body).decode(), "the status never shows the token"


# ---- events ----------------------------------------------------------------------------------
async def test_events_page_by_sequence_number_and_say_what_fell_out_of_the_ring(node):
    first = node.hub.snapshot()["last_seq"] + 1
    for i in range(RING + 3):
        node.hub.emit("info", "test", f"event {i}")
    last = first + RING + 2
    page = (await node.client.get("/v1/events", params={"since": first, "limit": 5})).json()
    assert page["missed"] == 3
    assert [e["message"] for e in page["events"]] == [f"event {i}" for i in range(3, 8)]
    assert set(page["events"][0]) == {"seq", "ts", "level", "component", "message"}
    assert page["events"][0]["seq"] == first + 3 and page["next_seq"] == first + 8
    rest = (await node.client.get("/v1/events", params={"since": page["next_seq"], "limit": 100})).json()
    assert rest["missed"] == 0 and [e["seq"] for e in rest["events"]] == [first + 8, first + 9, last]
    caught_up = (await node.client.get("/v1/events", params={"since": rest["next_seq"]})).json()
    assert caught_up == {"events": [], "next_seq": last + 1, "missed": 0}
    everything = (await node.client.get("/v1/events", params={"limit": 10**9})).json()
    assert len(everything["events"]) == RING, "a huge limit is capped, not refused; since defaults to 0"


@pytest.mark.parametrize("params", [{"since": "-1"}, {"since": "x"}, {"limit": "0"}, {"since": "１"}, {"limit": "1e3"}])
async def test_malformed_event_queries_are_refused(node, params):
    response = await node.client.get("/v1/events", params=params)
    assert response.status_code == 400 and error_of(response)["type"] == "invalid_request"


async def read_stream(response: httpx.Response, count: int) -> tuple[list[dict], list[dict]]:
    """The next `count` events of an SSE response, and any `missed` notices before them."""
    events, missed, kind, lines = [], [], None, response.aiter_lines()
    while len(events) < count:
        line = await anext(lines)
        if line.startswith("event: "):
            kind = line.removeprefix("event: ")
        elif line.startswith("data: "):
            (missed if kind == "missed" else events).append(orjson.loads(line.removeprefix("data: ")))
            kind = None
    return events, missed


async def test_the_stream_delivers_events_emitted_after_connecting_and_ends_when_the_client_leaves(node):
    since = node.hub.snapshot()["last_seq"] + 1
    with trio.fail_after(TIMEOUT_S), logged("engy.control", "event stream ended") as ended:
        async with node.client.stream("GET", "/v1/events/stream", params={"since": since}) as response:
            assert response.status_code == 200
            assert response.headers["content-type"].startswith("text/event-stream")
            for i in range(3):
                node.hub.emit("warning", "miner", f"live {i}")
            events, missed = await read_stream(response, 3)
            assert [e["message"] for e in events] == ["live 0", "live 1", "live 2"]
            assert events[0]["seq"] == since and events[0]["level"] == "warning" and not missed
        await ended.wait(timeout_s=TIMEOUT_S, what="the server ending the stream after the client left")
    assert f"at seq {since + 3}" in ended.message


async def test_a_stream_reader_behind_the_ring_is_told_how_many_it_missed(node):
    first = node.hub.snapshot()["last_seq"] + 1
    for i in range(RING + 2):
        node.hub.emit("info", "test", f"event {i}")
    with trio.fail_after(TIMEOUT_S):
        async with node.client.stream("GET", "/v1/events/stream", params={"since": first}) as response:
            events, missed = await read_stream(response, RING)
    assert missed == [{"missed": 2}]
    assert [e["message"] for e in events] == [f"event {i}" for i in range(2, RING + 2)]


async def test_a_reconnecting_event_source_resumes_after_its_last_event_id(node):
    first = node.hub.snapshot()["last_seq"] + 1
    for i in range(3):
        node.hub.emit("info", "test", f"event {i}")
    with trio.fail_after(TIMEOUT_S):
        async with node.client.stream("GET", "/v1/events/stream", headers={"last-event-id": str(first)}) as response:
            events, _ = await read_stream(response, 2)
    assert [e["message"] for e in events] == ["event 1", "event 2"]
    assert STREAM_POLL_S <= 0.5, "the TUI renders at 2-5 Hz; events must reach it within a frame or two"


# ---- metrics ---------------------------------------------------------------------------------
async def test_metrics_are_prometheus_text(node):
    node.hub.registry.counter("engy_test_requests_total", "requests served").inc(2)
    response = await node.client.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain; version=0.0.4")
    assert "# TYPE engy_test_requests_total counter" in response.text
    assert "engy_test_requests_total 2.0" in response.text


# ---- actions ---------------------------------------------------------------------------------
async def test_actions_are_listed_and_run_with_their_parameters(node):
    async def echo(params: dict) -> dict:
        return {"got": params}

    node.actions.register("pause-traffic", "stop routing requests here", echo)
    node.actions.register("echo", "answer the parameters", echo)
    listed = (await node.client.get("/v1/actions")).json()
    assert listed == {
        "actions": [
            {"id": "echo", "description": "answer the parameters"},
            {"id": "pause-traffic", "description": "stop routing requests here"},
        ]
    }
    ran = await node.client.post("/v1/actions/echo", json={"level": "debug"})
    assert ran.status_code == 200 and ran.json() == {"action": "echo", "result": {"got": {"level": "debug"}}}
    without_body = await node.client.post("/v1/actions/echo")
    assert without_body.json()["result"] == {"got": {}}


async def test_an_unknown_action_names_the_known_ones(node):
    async def noop(params: dict) -> dict:
        return {}

    node.actions.register("restart-model-server", "restart sglang", noop)
    response = await node.client.post("/v1/actions/reboot")
    assert response.status_code == 404
    assert "restart-model-server" in error_of(response)["message"]


async def test_action_failures_answer_with_the_status_that_fits(node):
    async def refuse(params: dict) -> dict:
        raise ConfigError("no model server runs on this node; start the miner role")

    async def crash(params: dict) -> dict:
        raise RuntimeError("bug")

    async def hang(params: dict) -> dict:
        await trio.sleep_forever()

    async def not_a_dict(params: dict) -> dict:
        return ["x"]

    node.actions.register("refuse", "refuses", refuse)
    node.actions.register("crash", "crashes", crash)
    node.actions.register("hang", "never finishes", hang, timeout_s=0.2)
    node.actions.register("list", "answers a list", not_a_dict)
    refused = await node.client.post("/v1/actions/refuse")
    assert refused.status_code == 400
    assert error_of(refused) == {
        "message": "no model server runs on this node; start the miner role",
        "type": "action_failed",
    }
    with logged("engy.control", "action crash failed") as logged_crash:
        crashed = await node.client.post("/v1/actions/crash")
    assert crashed.status_code == 500 and error_of(crashed)["type"] == "internal_error"
    assert logged_crash.message is not None
    hung = await node.client.post("/v1/actions/hang")
    assert hung.status_code == 504 and "0.2 s" in error_of(hung)["message"]
    listed = await node.client.post("/v1/actions/list")
    assert listed.status_code == 500


@pytest.mark.parametrize("content, status", [(b"[1]", 400), (b"{not json", 400), (b"x" * (65 * 1024), 413)])
async def test_bad_action_bodies_are_refused(node, content, status):
    async def echo(params: dict) -> dict:
        return params

    node.actions.register("echo", "answer the parameters", echo)
    response = await node.client.post("/v1/actions/echo", content=content)
    assert response.status_code == status and "error" in response.json()


def test_action_ids_are_checked_at_registration():
    async def noop(params: dict) -> dict:
        return {}

    actions = Actions()
    actions.register("restart-model-server", "restart", noop)
    with pytest.raises(ValueError, match="already registered"):
        actions.register("restart-model-server", "again", noop)
    with pytest.raises(ValueError, match="lowercase"):
        actions.register("Restart Model", "bad id", noop)
    with pytest.raises(ValueError, match="positive"):
        actions.register("slow", "no time at all", noop, timeout_s=0)


# ---- the listener ----------------------------------------------------------------------------
@pytest.mark.parametrize("host", ["0.0.0.0", "::", "192.168.1.10", "example.com", ""])
async def test_a_non_loopback_host_is_refused(nursery, tmp_path, host):
    with pytest.raises(ConfigError, match="loopback only"):
        await nursery.start(
            functools.partial(serve_control, Hub(), data_dir=tmp_path, actions=Actions(), node_info={}, host=host)
        )
    assert not token_path(tmp_path).exists(), "refused before anything is written"


def test_loopback_hosts_make_bind_strings():
    assert loopback_bind("127.0.0.1", 0) == "127.0.0.1:0"
    assert loopback_bind("localhost", 7000) == "127.0.0.1:7000"
    assert loopback_bind("::1", 7000) == "[::1]:7000"
    assert loopback_bind("[::1]", 7000) == "[::1]:7000"
    with pytest.raises(ConfigError, match="port number"):
        loopback_bind("127.0.0.1", 70000)


async def test_a_busy_port_is_a_config_error_naming_the_setting(nursery, tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        with pytest.raises(ConfigError, match="control.port"):
            await nursery.start(
                functools.partial(
                    serve_control, Hub(), data_dir=tmp_path, actions=Actions(), node_info={}, port=busy.getsockname()[1]
                )
            )


async def test_the_endpoint_record_exists_while_serving_and_a_restart_keeps_the_token(tmp_path):
    data_dir = tmp_path / "data"
    tokens = []
    for _ in range(2):
        async with trio.open_nursery() as nursery:
            endpoint = await nursery.start(
                functools.partial(serve_control, Hub(), data_dir=data_dir, actions=Actions(), node_info={})
            )
            assert read_endpoint(data_dir) == endpoint
            assert str(endpoint) == f"{endpoint.url} (token in {token_path(data_dir)})"
            assert stat.S_IMODE(endpoint_path(data_dir).stat().st_mode) == 0o600
            tokens.append(read_token(endpoint.token_file))
            nursery.cancel_scope.cancel()
        assert not endpoint_path(data_dir).exists(), "a stopped node leaves no endpoint behind"
    assert tokens[0] == tokens[1]


# ---- the CLI's client ------------------------------------------------------------------------
async def test_fetch_status_reads_a_running_node(node):
    endpoint = read_endpoint(node.data_dir)
    status = await trio.to_thread.run_sync(
        functools.partial(fetch_status, endpoint.url, read_token(endpoint.token_file), timeout=TIMEOUT_S)
    )
    assert status["node"] == NODE_INFO and "states" in status


async def test_fetch_status_with_a_wrong_token_names_the_token_file(node):
    with pytest.raises(ControlAuthError, match="refused the control token") as raised:
        await trio.to_thread.run_sync(functools.partial(fetch_status, node.endpoint.url, "wrong", timeout=TIMEOUT_S))
    assert str(token_path(node.data_dir)) in str(raised.value)


def test_fetch_status_with_nothing_listening_says_the_node_is_not_running():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with pytest.raises(NodeNotRunningError, match="no engy node answers at .*start one"):
        fetch_status(f"http://127.0.0.1:{port}", "token", timeout=TIMEOUT_S)


async def test_every_node_can_change_its_log_level_and_a_wrong_level_names_the_choices(engy_logger):
    from engy_node.control import ControlError, node_actions
    from engy_node.hub import Hub, install_logging

    action = node_actions().get("set-log-level")
    assert action is not None
    install_logging(Hub(), level="info")
    assert await action.handler({"level": "debug"}) == {"level": "debug"}
    with pytest.raises(ControlError, match="choose one of debug, info, warning, error"):
        await action.handler({"level": "loud"})
