"""What the miner tab shows for the node's states at one time: which miners this node runs, and for
each the lines of its blocks (model server, gateway link, proofs, chain), plus the node's own
proofs.

This is the one place that picks each block's inputs out of the typed states (`NodeStates`):
the miner's `MinerState`, its model server's `ModelServerState`, the traffic worker and gateway
legs of its hotkey, the network, chain, verifier and audit states and node info's `hotkeys`.
Plain data out, so the widget can skip a repaint when nothing changed by comparing two views.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Literal

from engy_node.protocol.gates import block_time_s
from engy_node.snapshots import MinerState, NodeStates, server_component
from engy_tui.widgets.cells import NA, Cell, short_hotkey
from engy_tui.widgets.cells import as_text as _text
from engy_tui.widgets.miner.common import Level, Line
from engy_tui.widgets.miner.earnings import chain_lines
from engy_tui.widgets.miner.epoch import epoch_notes, epoch_summary
from engy_tui.widgets.miner.link import (
    legs_cell,
    legs_of,
    link_lines,
    link_notes,
    link_summary,
    link_title,
    work_summary,
    worker_of,
)
from engy_tui.widgets.miner.proofs import gateway_proof_lines, node_proof_lines, proved_by_line
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
    "miner_view",
    "panel_view",
]


def miner_hotkey(miner: str, names: Mapping[str, str] | None, state: MinerState | None = None) -> str | None:
    """`miner`'s ss58 hotkey: node info's `hotkeys`[name] (a local network names its miners'
    hotkeys after their components), else a `hotkey` the miner state carries."""
    return _text((names or {}).get(miner)) or (_text(state.hotkey) if state else None)


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
    """`link` on one line, for a compact block."""
    work_summary: Line | None
    """What the gateway served and audited of it, and the breaker's window, on one line for a
    compact block (None when no gateway on this node knows it)."""
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


ServerLog = Mapping[str, Sequence[str]]


def _server_log(server_log: ServerLog | None, miner: str, several: bool) -> tuple[Sequence[str], bool]:
    """This server's lines, and whether they are every server's: the supervisor logs under one
    component ("model_server") whichever miner it serves, so the app may only have those."""
    logs = server_log or {}
    own = logs.get(server_component(miner))
    if own is not None:
        return own, False
    shared = logs.get(server_component("miner"))
    return (shared, several) if shared is not None else ((), False)


def miner_view(
    name: str,
    states: NodeStates,
    *,
    now: float,
    names: Mapping[str, str] | None = None,
    server_log: ServerLog | None = None,
    several: bool = False,
) -> MinerView:
    """One miner's block for the node's `states` at wall-clock `now`; `names` is node info's
    `hotkeys` {name: ss58}, `server_log` {component: [newest lines]}."""
    miner = states.miners.get(name)
    server = states.model_servers.get(name)
    hotkey = miner_hotkey(name, names, miner)
    has_traffic = states.traffic is not None
    worker = worker_of(states.traffic, hotkey, miner.model if miner else None)
    legs = legs_of(states.gateway, hotkey)
    url = _text(states.network.miner_ws) if states.network else None

    failure = failure_lines(server)
    down = server is not None and server.state in DOWN
    lines, shared = _server_log(server_log, name, several)
    legs_style = legs_cell(miner).style
    link_level: Level = (
        "error"
        if legs_style == "error" or (worker is not None and worker.state == "pulled")
        else "warning"
        if legs_style == "warning"
        else ""
    )
    gateway = gateway_proof_lines(worker)
    proved_by = proved_by_line(miner)
    proofs = (
        *((proved_by,) if proved_by else ()),
        *((Cell("gateway: ", "header"), *line) if i == 0 else line for i, line in enumerate(gateway)),
    )
    short = short_hotkey(hotkey) if hotkey else NA
    epoch = miner.epoch if miner else None
    summary = epoch_summary(epoch)
    if epoch is not None and epoch.gated:
        link_level = "error"  # it served, and earns nothing for it: as red as a pull
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
        work_summary=work_summary(worker),
        link_notes=(
            *link_notes(miner, worker, now=now),
            *epoch_notes(epoch, now=now, block_s=block_time_s(epoch, states.chain, states.validator)),
        ),
        proofs=proofs,
        chain_title=f"{name} ({short})" if hotkey else name,
        chain=(*chain_lines(states.chain, hotkey), *((summary,) if summary else ())),
    )


def panel_view(
    states: NodeStates | None,
    *,
    now: float,
    names: Mapping[str, str] | None = None,
    server_log: ServerLog | None = None,
) -> PanelView:
    """What the panel shows for the node's states (None before the first snapshot) at wall-clock
    `now`. `names` defaults to node info's `hotkeys` (a local network publishes them)."""
    if states is None:
        states = NodeStates()
    if names is None:
        names = states.node.hotkeys
    miners = states.miner_names()
    proofs = tuple(node_proof_lines(states))
    if not miners:
        why = "waiting for the node's first snapshot" if states == NodeStates() else "no miner on this node"
        return PanelView("empty", (), proofs, (Cell(why, "na"),))
    several = len(miners) > 1
    views = tuple(
        miner_view(name, states, now=now, names=names, server_log=server_log, several=several) for name in miners
    )
    return PanelView("compact" if several else "full", views, proofs, ())
