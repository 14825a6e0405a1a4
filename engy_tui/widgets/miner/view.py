"""What the miner tab shows for the hub's states at one time: which miners this node runs, and for
each the lines of its blocks (model server, gateway link, proofs, chain), plus the node's own
proofs.

This is the one place that picks each block's inputs out of the states: the miner's component,
its model server's, the traffic worker and gateway legs of its hotkey, the "network", "chain",
"verifier" and "audit" states and node info's `hotkeys`. Plain data out, so the widget can skip a
repaint when nothing changed by comparing two views.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from typing import Any, Literal

from engy_tui.widgets.cells import NA, Cell, short_hotkey
from engy_tui.widgets.cells import as_map as _map
from engy_tui.widgets.cells import as_text as _text
from engy_tui.widgets.miner.common import Level, Line
from engy_tui.widgets.miner.earnings import chain_lines
from engy_tui.widgets.miner.link import legs_cell, legs_of, link_lines, link_notes, link_summary, link_title, worker_of
from engy_tui.widgets.miner.proofs import gateway_proof_line, node_proof_lines
from engy_tui.widgets.miner.serving import (
    DOWN,
    FAILED_LOG_LINES,
    LOG_LINES,
    command_line,
    failure_lines,
    load_line,
    log_lines,
    plan_line,
    server_level,
    server_title,
)

__all__ = [
    "MinerView",
    "PanelView",
    "miner_hotkey",
    "miner_names",
    "miner_view",
    "panel_view",
    "server_component",
]


def _natural(name: str) -> tuple[tuple[int, int, str], ...]:
    # miner-2 before miner-10; digits compare by length then text, so no int() of huge numbers.
    return tuple(
        (0, 0, part) if i % 2 == 0 else (1, len(part), part) for i, part in enumerate(re.split(r"(\d+)", name))
    )


def miner_names(states: Any) -> list[str]:
    """The miners of this node, in natural order: every "miner"/"miner-…" component, and the
    miner of every "model_server"/"model_server.…" one (its server may report first)."""
    found = set()
    for key, value in _map(states).items():
        if not isinstance(key, str) or not isinstance(value, Mapping):
            continue
        if not key.isprintable():
            continue
        if key == "miner" or (key.startswith("miner-") and len(key) > 6):
            found.add(key)
        elif key == "model_server":
            found.add("miner")
        elif key.startswith("model_server.") and len(key) > 13:
            found.add(key.removeprefix("model_server."))
    return sorted(found, key=_natural)


def server_component(miner: str) -> str:
    """The hub component of `miner`'s model server (`role.run_miner`, `local.up._miner_service`)."""
    return "model_server" if miner == "miner" else f"model_server.{miner}"


def miner_hotkey(miner: str, names: Any, state: Any = None) -> str | None:
    """`miner`'s ss58 hotkey: node info's `hotkeys`[name] (a local network names its miners'
    hotkeys after their components), else a `hotkey` the miner state carries."""
    return _text(_map(names).get(miner)) or _text(_map(state).get("hotkey"))


@dataclasses.dataclass(frozen=True, slots=True)
class MinerView:
    """Everything one miner's block shows."""

    name: str
    server_title: str
    server_level: Level
    command: Line
    plan: Line | None
    load: Line
    failure: tuple[Line, ...]
    log: tuple[Line, ...]
    link_title: str
    link_level: Level
    link: tuple[Line, ...]
    link_summary: Line
    """`link` and `proofs` on one line, for a compact block."""
    link_notes: tuple[Line, ...]
    proofs: tuple[Line, ...]
    """This miner's verdicts at a gateway on this node (empty when there is none)."""
    chain_title: str
    chain: tuple[Line, ...]


@dataclasses.dataclass(frozen=True, slots=True)
class PanelView:
    mode: Literal["empty", "full", "compact"]
    miners: tuple[MinerView, ...]
    proofs: tuple[Line, ...]
    """The node's own proof counts (verifier, audit queue)."""
    empty: Line


def _server_log(server_log: Any, miner: str, several: bool) -> tuple[Any, bool]:
    """This server's lines, and whether they are every server's: the supervisor logs under one
    component ("model_server") whichever miner it serves, so the app may only have those."""
    logs = _map(server_log)
    own = logs.get(server_component(miner))
    if isinstance(own, (list, tuple)):
        return own, False
    shared = logs.get("model_server")
    return (shared, several) if isinstance(shared, (list, tuple)) else ((), False)


def miner_view(
    name: str, states: Any, *, now: float, names: Any = None, server_log: Any = None, several: bool = False
) -> MinerView:
    """One miner's block for the hub's `states` at wall-clock `now`; `names` is node info's
    `hotkeys` {name: ss58}, `server_log` {component: [newest lines]}."""
    states = _map(states)
    miner = _map(states.get(name))
    server = _map(states.get(server_component(name)))
    hotkey = miner_hotkey(name, names, miner)
    traffic = states.get("traffic")
    has_traffic = isinstance(traffic, Mapping)
    worker = worker_of(traffic, hotkey, _text(miner.get("model")))
    legs = legs_of(states.get("gateway"), hotkey)
    url = _text(_map(states.get("network")).get("miner_ws"))

    failure = failure_lines(server)
    down = _text(server.get("state")) in DOWN
    lines, shared = _server_log(server_log, name, several)
    link_level: Level = (
        "error"
        if legs_cell(miner).style == "error" or _text(_map(worker).get("state")) == "pulled"
        else "warning"
        if legs_cell(miner).style == "warning"
        else ""
    )
    window = gateway_proof_line(worker)
    proofs = ((Cell("gateway: ", "header"), *window),) if window is not None else ()
    short = short_hotkey(hotkey) if hotkey else NA
    return MinerView(
        name=name,
        server_title=server_title(miner, server),
        server_level=server_level(miner, server),
        command=command_line(miner, server),
        plan=plan_line(miner),
        load=load_line(server),
        failure=tuple(failure),
        log=tuple(log_lines(lines, shared=shared, limit=FAILED_LOG_LINES if down else LOG_LINES)),
        link_title=link_title(miner, worker, has_traffic=has_traffic, hotkey=hotkey, url=url),
        link_level=link_level,
        link=tuple(link_lines(miner, worker, legs, now=now, has_traffic=has_traffic)),
        link_summary=link_summary(miner, worker, legs, now=now, has_traffic=has_traffic, hotkey=hotkey),
        link_notes=tuple(link_notes(miner, worker, now=now)),
        proofs=proofs,
        chain_title=f"{name} ({short})" if hotkey else name,
        chain=tuple(chain_lines(states.get("chain"), hotkey)),
    )


def panel_view(states: Any, *, now: float, names: Any = None, server_log: Any = None) -> PanelView:
    """What the panel shows for the hub's states (None before the first snapshot) at wall-clock
    `now`. `names` defaults to the "node" state's `hotkeys` (a local network publishes them)."""
    states = _map(states)
    if names is None:
        names = _map(states.get("node")).get("hotkeys")
    miners = miner_names(states)
    proofs = tuple(node_proof_lines(states))
    if not miners:
        why = "waiting for the node's first snapshot" if not states else "no miner on this node"
        return PanelView("empty", (), proofs, (Cell(why, "na"),))
    several = len(miners) > 1
    views = tuple(
        miner_view(name, states, now=now, names=names, server_log=server_log, several=several) for name in miners
    )
    return PanelView("compact" if several else "full", views, proofs, ())
