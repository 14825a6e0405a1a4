"""The HAProxy configuration in front of a gateway fleet: one public buyer port and one public
miner port for every host behind them (docs/scale-out.md).

What it must route, and why so:

* Buyers (`/v1/...`) go to any healthy host, least connections first: every host serves every
  buyer, its state being in the shared store. A host is taken out after three failed `/health`
  checks a second apart (each may take up to 5 s: a host busy with a storm of miner legs is slow,
  not gone), and a request whose connection to a host fails is sent to another
  (`retry-on conn-failure`: only then is it certain that host never saw the request; a retry
  after it had, of a request that may already have been charged, is the buyer's SDK's call).
* Miner legs (`/gw/{i}`) go by path to the host that serves leg i, because each gateway worker
  routes its buyers only to the legs it holds (docs/protocol.md); every other host is that leg's backup,
  so when its host is down the miner's re-dial lands on a survivor (`leg_worker` spreads such
  legs over its workers) and the fleet's capacity stays whole. `/gw/meta` and `/gw` go to any
  healthy host: `/gw/meta` tells the fleet's leg count wherever it is asked.
* Websocket legs and long streams live through `timeout tunnel`; legs beat every 30 s.

Pure: the layout in, the configuration text out, so tests and `engy-node gateway haproxy-config`
print the same text the documentation shows.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


@dataclasses.dataclass(frozen=True, slots=True)
class FleetHost:
    """One gateway host as the balancer reaches it."""

    name: str
    address: str
    """Hostname or IP the balancer connects to."""
    buyer_port: int
    miner_port: int
    first_leg: int
    """`gateway.fleet_offset` on that host."""
    legs: int
    """`gateway.workers` on that host."""

    def __post_init__(self) -> None:
        if not _NAME.fullmatch(self.name):
            raise ValueError(f"host name {self.name!r}: use letters, digits and . _ - (it names HAProxy servers)")
        for port in (self.buyer_port, self.miner_port):
            if not 0 < port < 65536:
                raise ValueError(f"host {self.name}: port {port} is not 1..65535")
        if self.first_leg < 0 or self.legs < 1:
            raise ValueError(f"host {self.name}: first_leg must be >= 0 and legs >= 1")


HOST_FORMAT = "NAME=ADDRESS:BUYER_PORT:MINER_PORT:FIRST_LEG:LEGS"


def parse_host(spec: str) -> FleetHost:
    """A host as the command line names it (`HOST_FORMAT`, e.g. `gw-a=10.0.0.1:8080:8081:0:2`)."""
    name, _, rest = spec.partition("=")
    parts = rest.rsplit(":", 4)
    if not name or len(parts) != 5 or not all(part.isdigit() for part in parts[1:]) or not parts[0]:
        raise ValueError(
            f"--host {spec!r}: write it as {HOST_FORMAT} (FIRST_LEG is that host's gateway.fleet_offset, "
            "LEGS its gateway.workers), e.g. gw-a=10.0.0.1:8080:8081:0:2"
        )
    address = parts[0].strip("[]")
    buyer_port, miner_port, first_leg, legs = (int(part) for part in parts[1:])
    return FleetHost(
        name=name, address=address, buyer_port=buyer_port, miner_port=miner_port, first_leg=first_leg, legs=legs
    )


def check_layout(hosts: Sequence[FleetHost]) -> int:
    """The fleet's leg count; raises ValueError unless the hosts' legs tile 0..N-1 exactly once."""
    if not hosts:
        raise ValueError("a fleet needs at least one host")
    if len({host.name for host in hosts}) != len(hosts):
        raise ValueError("host names must be unique")
    legs = sorted(leg for host in hosts for leg in range(host.first_leg, host.first_leg + host.legs))
    if legs != list(range(len(legs))):
        raise ValueError(
            f"the hosts' legs must cover 0..{len(legs) - 1} once each (gateway.fleet_offset and workers per "
            f"host); they cover {legs}"
        )
    return len(legs)


def haproxy_config(
    hosts: Sequence[FleetHost],
    *,
    bind: str = "0.0.0.0",
    buyer_port: int = 8080,
    miner_port: int = 8081,
    check_interval_ms: int = 1000,
    stats_port: int | None = None,
) -> str:
    """The whole `haproxy.cfg` for `hosts`, listening for buyers on `bind:buyer_port` and for
    miners on `bind:miner_port`."""
    fleet_legs = check_layout(hosts)
    check = f"check inter {check_interval_ms} fall 3 rise 2"
    lines = [
        f"# engy gateway fleet: {len(hosts)} host(s), {fleet_legs} miner leg(s). Each host sets",
        "# gateway.store_url (the shared PostgreSQL), gateway.fleet_legs = "
        f"{fleet_legs} and its own gateway.fleet_offset.",
        "global",
        # Without a maxconn HAProxy sizes itself to the file-descriptor limit it is given
        # (LimitNOFILE in its systemd unit): raise that, not a number here, for more connections.
        "    log stderr format short local0 warning",
        "",
        "defaults",
        "    log global",
        "    mode http",
        "    option http-keep-alive",
        "    timeout connect 2s",
        "    timeout http-request 60s",
        "    timeout client 10m",
        "    timeout server 10m",
        "    timeout tunnel 1h",
        "    timeout queue 5s",
        # A host busy admitting a storm of miner legs answers its check late, not never: a check
        # timed out at its interval would take every host out at once and turn the storm into
        # 503s and miner back-offs (bench/fleet.py measured 9-18 s with no server at all).
        "    timeout check 5s",
        "    retries 2",
        "    option redispatch",
        "    retry-on conn-failure",
        "",
        "frontend buyers",
        f"    bind {bind}:{buyer_port}",
        "    default_backend buyers",
        "",
        "backend buyers",
        "    balance leastconn",
        "    option httpchk GET /health",
        "    http-check expect status 200",
        *(f"    server {host.name} {host.address}:{host.buyer_port} {check}" for host in hosts),
        "",
        "frontend miners",
        f"    bind {bind}:{miner_port}",
    ]
    for host in hosts:
        alternatives = "|".join(str(leg) for leg in range(host.first_leg, host.first_leg + host.legs))
        lines.append(f"    use_backend legs_{host.name} if {{ path_reg ^/gw/({alternatives})$ }}")
    lines += [
        "    default_backend miners",
        "",
        "backend miners",
        "    balance roundrobin",
        "    option httpchk GET /gw/meta",
        *(f"    server {host.name} {host.address}:{host.miner_port} {check}" for host in hosts),
    ]
    for host in hosts:
        lines += [
            "",
            f"backend legs_{host.name}",
            "    option httpchk GET /gw/meta",
            f"    server {host.name} {host.address}:{host.miner_port} {check}",
            *(
                f"    server {other.name} {other.address}:{other.miner_port} {check} backup"
                for other in hosts
                if other is not host
            ),
        ]
    if stats_port is not None:
        lines += [
            "",
            "frontend stats",
            f"    bind 127.0.0.1:{stats_port}",
            "    stats enable",
            "    stats uri /",
            "    stats refresh 5s",
        ]
    return "\n".join(lines) + "\n"
