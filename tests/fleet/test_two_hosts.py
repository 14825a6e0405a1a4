"""Two gateway hosts behind HAProxy on one PostgreSQL store, miners and buyers through the one
public address; one host is killed (`kill -9`) in the middle of traffic. Service goes on: the
miners' legs re-dial through the balancer to the survivor, buyers' requests (retried by their
SDK where the dead host had them) are answered, the survivor takes the leader lease, and the
ledger's invariants hold across both hosts' writes.

Everything is real and on loopback: `engy-node --role gateway` processes, Debian's HAProxy with
the configuration `load_balancer.haproxy_config` writes (the one docs/scale-out.md shows), a
throwaway PostgreSQL cluster, synthetic miners on the real websocket link, OpenAI SDK buyers.
"""

from __future__ import annotations

import dataclasses
import subprocess
import time

import httpx
import openai
import trio

from engy_node.gateway.fleet.load_balancer import FleetHost, haproxy_config
from engy_node.models import SMOLLM2_135M
from engy_node.served_model import load_served_model
from engy_node.testing.faults import ProcessAccount, check_books
from engy_node.testing.synthetic_miner import Script
from tests.faults.conftest import new_buyer, start_synthetic_miner, words
from tests.faults.nodes import GatewayProcess, NodeProcess, free_port
from tests.waiting import ProcessOutput

LEASE_S = 4.0
BUYERS = 6
MINERS = 2
ANSWER = words(8)
TRAFFIC_BEFORE_KILL_S = 4.0
TRAFFIC_AFTER_KILL_S = 10.0
CALL_TIMEOUT_S = 30.0


class Balancer(NodeProcess):
    """HAProxy in the foreground (`-db`), reading the fleet's configuration from `HOME/haproxy.cfg`."""

    def __init__(self, home, account: ProcessAccount, binary: str, config_text: str) -> None:
        config = home / "haproxy.cfg"
        config.write_text(config_text)
        check = subprocess.run([binary, "-c", "-f", str(config)], capture_output=True, text=True)
        assert check.returncode == 0, check.stdout + check.stderr
        super().__init__(home, [], {}, account, name="haproxy")
        self.command = [binary, "-db", "-f", str(config)]

    def start(self) -> None:
        self.starts += 1
        self.process = subprocess.Popen(
            self.command,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            encoding="utf-8",
            errors="replace",
        )
        self.output = ProcessOutput(self.process, self.home / "haproxy.log")
        self.account.note(self.process.pid)


@dataclasses.dataclass
class Outcome:
    started_at: float
    ended_at: float
    ok: bool
    error: str = ""


async def wait_http(url: str, *, timeout_s: float = 30.0) -> None:
    with trio.fail_after(timeout_s):
        async with httpx.AsyncClient(timeout=2.0) as http:
            while True:
                try:
                    if (await http.get(url)).status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                await trio.sleep(0.1)


async def buyer(api: str, key: str, index: int, outcomes: list[Outcome], stop: trio.Event) -> None:
    """One buyer sending requests back to back until `stop`, streamed and plain by turns, through
    the OpenAI SDK with its default retries (a request the dead host had is retried by the SDK
    where it can be: a plain one whose connection dropped)."""
    async with httpx.AsyncClient(timeout=CALL_TIMEOUT_S) as http:
        client = openai.AsyncOpenAI(base_url=api, api_key=key, http_client=http, timeout=CALL_TIMEOUT_S)
        turn = 0
        while not stop.is_set():
            turn += 1
            started = time.monotonic()
            messages = [{"role": "user", "content": f"buyer {index} request {turn}"}]
            try:
                with trio.fail_after(CALL_TIMEOUT_S):
                    if turn % 2:
                        text = ""
                        stream = await client.chat.completions.create(
                            model=SMOLLM2_135M.id, messages=messages, max_tokens=32, stream=True
                        )
                        async for chunk in stream:
                            if chunk.choices and chunk.choices[0].delta.content:
                                text += chunk.choices[0].delta.content
                    else:
                        completion = await client.chat.completions.create(
                            model=SMOLLM2_135M.id, messages=messages, max_tokens=32
                        )
                        text = completion.choices[0].message.content or ""
                outcomes.append(
                    Outcome(started, time.monotonic(), ok=text == ANSWER, error="" if text == ANSWER else repr(text))
                )
            except (openai.APIError, httpx.HTTPError, trio.TooSlowError) as error:
                outcomes.append(Outcome(started, time.monotonic(), ok=False, error=f"{type(error).__name__}: {error}"))
                await trio.sleep(0.05)


async def test_killing_one_of_two_gateway_hosts_mid_traffic_leaves_service_and_books_whole(
    tmp_path, postgres_url, checkpoint, haproxy_binary
):
    account = ProcessAccount(tmp_path)
    for name in ("gw-a", "gw-b"):
        (tmp_path / name).mkdir()
    lb_buyer_port, lb_miner_port = free_port(), free_port()
    fleet = {"store_url": postgres_url, "fleet_legs": 2, "leader_lease_s": LEASE_S, "workers": 1}
    hosts = [
        GatewayProcess(tmp_path / name, account, host_name=name, fleet_offset=offset, **fleet)
        for offset, name in enumerate(("gw-a", "gw-b"))
    ]
    layout = [
        FleetHost(
            name=h.env["ENGY_GATEWAY__HOST_NAME"],
            address="127.0.0.1",
            buyer_port=h.buyer_port,
            miner_port=h.miner_port,
            first_leg=offset,
            legs=1,
        )
        for offset, h in enumerate(hosts)
    ]
    balancer = Balancer(
        tmp_path,
        account,
        haproxy_binary,
        haproxy_config(
            layout, bind="127.0.0.1", buyer_port=lb_buyer_port, miner_port=lb_miner_port, check_interval_ms=500
        ),
    )
    served = await trio.to_thread.run_sync(load_served_model, SMOLLM2_135M, checkpoint)
    try:
        for host in hosts:
            await host.start_from_trio()
        balancer.start()
        api, miner_url = f"http://127.0.0.1:{lb_buyer_port}/v1", f"ws://127.0.0.1:{lb_miner_port}/gw"
        await wait_http(f"http://127.0.0.1:{lb_buyer_port}/health")
        async with httpx.AsyncClient(timeout=5) as http:
            assert (await http.get(f"http://127.0.0.1:{lb_miner_port}/gw/meta")).json() == {"workers": 2}
        keys = [new_buyer(postgres_url, dollars=5.0)[1] for _ in range(BUYERS)]
        outcomes: list[Outcome] = []
        stop = trio.Event()
        async with httpx.AsyncClient(timeout=10) as http, trio.open_nursery() as nursery:
            miners = [
                await start_synthetic_miner(
                    nursery,
                    store_path=postgres_url,
                    miner_url=miner_url,
                    served=served,
                    http=http,
                    script=lambda frame: Script(text=ANSWER, chunk_chars=8, coalesce_s=0.0),
                    name=f"rig-{i}",
                )
                for i in range(MINERS)
            ]
            for miner in miners:
                await miner.wait_legs(2)  # one leg on each host, by path through the balancer
            leader_line = await trio.to_thread.run_sync(
                lambda: [h for h in hosts if "this host leads the gateway fleet" in h.text()]
            )
            for index, key in enumerate(keys):
                nursery.start_soon(buyer, api, key, index, outcomes, stop)
            await trio.sleep(TRAFFIC_BEFORE_KILL_S)
            served_before = sum(o.ok for o in outcomes)
            victim = leader_line[0] if leader_line else hosts[0]
            survivor = hosts[1] if victim is hosts[0] else hosts[0]
            killed_at = victim.kill()
            await trio.sleep(TRAFFIC_AFTER_KILL_S)
            stop.set()
            for miner in miners:
                await miner.wait_legs(2, timeout_s=15)  # both legs again, the dead host's now on the survivor
            nursery.cancel_scope.cancel()

        after = [o for o in outcomes if o.started_at > killed_at + 3.0]
        first_after = min((o.ended_at for o in outcomes if o.ok and o.started_at > killed_at), default=float("nan"))
        print(
            f"\nfleet failover: {served_before} answered before the kill of {victim.env['ENGY_GATEWAY__HOST_NAME']} "
            f"(leader: {victim in leader_line}), {sum(o.ok for o in outcomes) - served_before} after, "
            f"{len([o for o in outcomes if not o.ok])} failed; first answer started after the kill came "
            f"{first_after - killed_at:.2f} s after it"
        )
        failed = [o for o in outcomes if not o.ok]
        assert served_before >= BUYERS, f"traffic reached the fleet before the kill ({served_before} answers)"
        assert after and all(o.ok for o in after), (
            f"requests after the failover all answered: {[o.error for o in after if not o.ok]}"
        )
        # Only what the dead host had in flight may fail: at most one request per buyer, around the kill.
        assert len(failed) <= BUYERS and all(o.started_at <= killed_at + 3.0 for o in failed), [o.error for o in failed]
        assert await trio.to_thread.run_sync(
            lambda: survivor.wait_for(
                "this host leads the gateway fleet", timeout_s=3 * LEASE_S, what="the survivor taking the leader lease"
            )
        )
        assert survivor.stop() == 0, survivor.text()  # drains: its requests in flight settle
        books = check_books(postgres_url, open_holds_allowed=True)
        assert books.charges >= served_before + len(after) and not books.unlogged_charges
        assert len(books.open_holds) <= BUYERS, (
            "only the dead host's requests in flight still hold money (until a sweep)"
        )
    finally:
        for process in (balancer, *hosts):
            if process.process is not None and process.process.poll() is None:
                process.stop()
    account.note_marked()
    assert account.alive() == [], "every process the test started has exited"
