"""The miner's graceful stop: the budget that fits systemd's, what happens to each request, and the
miner (`run_miner` on the reference server, against a protocol-level gateway) stopped the way a
node stops it, with requests in flight.

A node stops its services by cancelling them (`node.run_services`); here the miner runs in a
cancel scope of its own that the test cancels, so the test can keep playing the gateway while
the miner drains.
"""

from __future__ import annotations

import logging
import os
import uuid

import pytest
import trio

from engy_node import config as budget_of_the_stop
from engy_node.config import MinerSection, load_config
from engy_node.errors import ConfigError
from engy_node.gateway.routing.router import Candidate, choose
from engy_node.hub import Hub
from engy_node.miner.drain import ABORTED_ERROR, MAX_DRAIN_S, REFUSED_ERROR, request_action, stop_budget
from engy_node.miner.link import CLOSE_TIMEOUT_S
from engy_node.miner.role import run_miner
from engy_node.miner.sglang.stopping import KILL_WAIT_S
from engy_node.miner.sglang.supervisor import OUTPUT_DRAIN_S, SupervisorSettings
from engy_node.models import SMOLLM2_135M
from engy_node.protocol.miner import Heartbeat, Message, ServeRequest, parse_miner_frame
from engy_node.serve.client import ABORT_TIMEOUT_S, ServeClient
from engy_node.testing.gateway import GatewayHarness
from tests.engy_node.miner.sglang.test_supervisor import is_running

# ---- the budget ----------------------------------------------------------------------------------


def test_the_longest_drain_allowed_still_fits_systemds_stop_with_the_margin():
    budget = stop_budget(drain_s=MAX_DRAIN_S)
    assert budget.total_s + budget_of_the_stop.NODE_MARGIN_S == budget_of_the_stop.SYSTEMD_STOP_S
    assert stop_budget(drain_s=MinerSection().drain_s).total_s < budget.total_s


def test_each_step_bound_covers_the_bound_it_restates():
    assert SupervisorSettings().stop_grace_s + KILL_WAIT_S + OUTPUT_DRAIN_S <= budget_of_the_stop.SERVER_STOP_S
    assert ABORT_TIMEOUT_S < budget_of_the_stop.ABORT_S, "the abort call, and time left to send the terminal responses"
    assert CLOSE_TIMEOUT_S <= budget_of_the_stop.CLOSE_S


@pytest.mark.parametrize("drain_s", [-1, float("inf"), True])
def test_a_drain_that_is_not_a_duration_is_refused(drain_s):
    with pytest.raises(ValueError, match="drain_s"):
        stop_budget(drain_s=drain_s)


def test_the_config_refuses_a_drain_that_would_outlast_systemds_stop(tmp_path):
    with pytest.raises(ConfigError, match=r"miner.drain_s = 48.0: must be 0..47 seconds"):
        load_config(home=tmp_path, env={"ENGY_MINER__DRAIN_S": "48"})
    assert load_config(home=tmp_path, env={"ENGY_MINER__DRAIN_S": "0"}).miner.drain_s == 0


# ---- what happens to a request -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("phase", "new", "action"),
    [
        ("serving", True, "serve"),
        ("serving", False, "continue"),
        ("finishing", True, "refuse"),
        ("finishing", False, "continue"),
        ("aborting", True, "refuse"),
        ("aborting", False, "abort"),
        ("closing", True, "refuse"),
        ("closing", False, "abort"),
    ],
)
def test_what_the_link_does_with_a_request_in_each_phase(phase, new, action):
    assert request_action(phase, new=new) == action


def test_the_gateway_reads_a_capacity_of_zero_and_routes_nothing_there():
    # What the gateway's pool does with the drain's heartbeat: it takes `capacity.max_inflight`
    # as the leg's capacity, and the router only picks legs with fewer requests than that.
    heartbeat = parse_miner_frame(
        '{"type": "heartbeat", "inflight": 1, "idle_seconds": 0, "capacity": {"max_inflight": 0}}'
    )
    assert isinstance(heartbeat, Heartbeat) and heartbeat.capacity.max_inflight == 0
    draining = Candidate(worker_id="draining", capacity=heartbeat.capacity.max_inflight, inflight=0)
    assert choose(candidates=[draining], prefix=None, rr_counter=0) is None
    assert (
        choose(
            candidates=[draining, Candidate(worker_id="open", capacity=2, inflight=1)], prefix=None, rr_counter=0
        ).worker_id
        == "open"
    )


# ---- the miner stopped with requests in flight ---------------------------------------------------


def request(text: str, *, max_tokens: int) -> ServeRequest:
    return ServeRequest(messages=(Message("user", text),), max_tokens=max_tokens, engy_request_id=uuid.uuid4().hex)


class EngyRecords(logging.Handler):
    """Every record of the `engy` loggers, in the order they were made."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[tuple[str, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append((record.name, record.getMessage()))

    def index(self, logger: str, fragment: str) -> int:
        """Where the first record of `logger` containing `fragment` is; fails the test if none is."""
        for index, (name, message) in enumerate(self.records):
            if name == logger and fragment in message:
                return index
        raise AssertionError(f"no record of {logger} contains {fragment!r}")

    def containing(self, fragment: str) -> list[str]:
        return [message for _, message in self.records if fragment in message]


@pytest.fixture
def engy_records(engy_logger):
    records = EngyRecords()
    engy_logger.addHandler(records)
    engy_logger.setLevel(logging.DEBUG)
    return records


class MinerRun:
    """`run_miner` in a cancel scope of its own: `stop` is what SIGTERM does to a node."""

    def __init__(self, tmp_path, gateway_url: str, *, drain_s: float) -> None:
        cache = {k: v for k, v in os.environ.items() if k == "ENGY_MODEL_CACHE"}
        self.config = load_config(
            home=tmp_path / "home",
            env=cache,
            overrides={"miner": {"gateway_url": gateway_url, "miner_key": "mk-drain", "drain_s": drain_s}},
        )
        self.hub = Hub()
        self.scope = trio.CancelScope()
        self.stopped = trio.Event()

    async def start(self, nursery: trio.Nursery) -> None:
        await nursery.start(self._run)

    async def _run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        try:
            with self.scope:
                await run_miner(self.config, self.hub, task_status=task_status)
        finally:
            self.stopped.set()

    @property
    def server_pid(self) -> int:
        return self.hub.states()["model_server"]["pid"]

    def stop(self) -> None:
        self.scope.cancel()

    async def wait_stopped(self) -> None:
        # The whole stop's bound, and a few seconds for a loaded test machine's scheduling.
        with trio.fail_after(stop_budget(drain_s=self.config.miner.drain_s).total_s + 10):
            await self.stopped.wait()


def capacity_zero_announced(leg) -> bool:
    return any(beat.capacity is not None and beat.capacity.max_inflight == 0 for beat in leg.heartbeats)


async def test_a_request_in_flight_when_the_miner_stops_finishes_and_one_routed_meanwhile_is_refused(
    nursery, tmp_path, checkpoint, engy_records
):
    harness = GatewayHarness(workers=1)
    await nursery.start(harness.run)
    miner = MinerRun(tmp_path, harness.url, drain_s=MAX_DRAIN_S)
    await miner.start(nursery)
    await harness.wait_for(lambda: 0 in harness.legs, timeout=120)
    leg = harness.legs[0]
    server_pid = miner.server_pid
    # It checked the weights it hands its model server against the catalog's pin.
    own = miner.hub.states()["miner"]
    assert (own["weights_root"], own["weights_pinned"]) == (SMOLLM2_135M.weights_root, True)
    # Short, so that it ends well within the drain even on a loaded CPU (a 48-token answer has
    # taken 90 s on a shared 2-core test machine), yet still runs when the late serve arrives.
    running = await harness.serve(request("Tell me a story about a dragon.", max_tokens=8), stream=True)
    await harness.wait_for(lambda: harness.requests[running].chunks, timeout=120)

    miner.stop()
    await harness.wait_for(lambda: capacity_zero_announced(leg), timeout=10)
    # Routed before the gateway read the heartbeat: refused at once, so the gateway retries it.
    late = await harness.result(await harness.serve(request("Say hello.", max_tokens=8)), timeout=10)
    assert (late.response.error, late.response.commitment, late.chunks) == (REFUSED_ERROR, None, [])
    finished = await harness.result(running, timeout=MAX_DRAIN_S + 10)
    assert finished.response.error is None and finished.response.commitment is not None
    assert "".join(finished.chunks) == finished.response.output["choices"][0]["message"]["content"]

    await miner.wait_stopped()
    assert leg.closed.is_set() and not harness.protocol_errors
    assert not is_running(server_pid)
    drained = engy_records.index(
        "engy.miner.link", "stopped serving: 1 request(s) ended within the drain, 0 aborted; 1 leg(s) closed"
    )
    assert drained < engy_records.index("engy.model_server", "stopping the model server"), (
        "the model server stops only after the legs are closed"
    )


async def test_past_the_deadline_a_request_is_aborted_on_the_running_model_server_and_the_gateway_told(
    nursery, tmp_path, checkpoint, engy_records, monkeypatch
):
    # The real abort, with its answer kept: True means the model server took it.
    aborts: list[bool] = []
    real_abort = ServeClient.abort

    async def abort_and_keep_the_answer(self, rid: str) -> bool:
        answered = await real_abort(self, rid)
        aborts.append(answered)
        return answered

    monkeypatch.setattr(ServeClient, "abort", abort_and_keep_the_answer)
    harness = GatewayHarness(workers=1)
    await nursery.start(harness.run)
    miner = MinerRun(tmp_path, harness.url, drain_s=0)
    await miner.start(nursery)
    await harness.wait_for(lambda: 0 in harness.legs, timeout=120)
    leg = harness.legs[0]
    server_pid = miner.server_pid
    corr_id = await harness.serve(request("Tell me a very long story about a dragon.", max_tokens=1500), stream=True)
    await harness.wait_for(lambda: harness.requests[corr_id].chunks, timeout=120)

    miner.stop()
    record = await harness.result(corr_id, timeout=30)
    assert (record.response.error, record.response.commitment) == (ABORTED_ERROR, None)
    await miner.wait_stopped()
    assert capacity_zero_announced(leg) and leg.closed.is_set()
    assert aborts and all(aborts), "every abort reached the model server while it was up"
    assert not engy_records.containing("could not abort")
    assert not is_running(server_pid)
    aborting = engy_records.index("engy.miner.link", "aborting 1 request(s) still running")
    drained = engy_records.index(
        "engy.miner.link", "stopped serving: 0 request(s) ended within the drain, 1 aborted; 1 leg(s) closed"
    )
    assert aborting < drained < engy_records.index("engy.model_server", "stopping the model server")
