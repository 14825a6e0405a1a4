"""Every tab of the node manager at 100 columns (issue 34): the header on one line, tables that
leave out their low-value columns rather than cut the key ones ("serv…"), a readable footer.
Pure functions first, then Pilot over the snapshot test's deterministic node (under
`asyncio.run`, as the other Pilot tests), then an SVG snapshot of each tab at 100×30."""

from __future__ import annotations

import asyncio

import pytest
from rich.cells import cell_len
from textual.app import App
from textual.widgets import Static, TabbedContent

from engy_tui.manager import NodeManager, header_text, roles_text
from engy_tui.widgets.cells import Cell, fit_columns
from engy_tui.widgets.miner import MinerPanel
from tests.engy_tui.test_manager_screens import EVENTS, node_snapshot
from tests.engy_tui.test_miner_panel import HOME, READY_LOG, Host, gpu_states
from tests.engy_tui.test_validator_panel import NOW

SIZE = (100, 30)
TABS = "1234567"


# ---- pure ----------------------------------------------------------------------------------------


def test_the_header_fits_100_columns_and_keeps_the_state_word():
    wide = header_text(node_snapshot(), mode="local", now=NOW).plain
    assert "miner-1, miner-2" in wide and "epoch 238170" in wide and "up 10 min" in wide
    narrow = header_text(node_snapshot(), mode="local", now=NOW, width=100).plain
    assert cell_len(narrow) <= 100
    assert narrow.startswith("engy-tui  chain, gateway, 2 miners, validator, verifier · local · block 1,540")
    assert narrow.endswith("● local")


def test_roles_fold_a_local_networks_miners_only_when_asked():
    roles = ["chain", "gateway", "miner-1", "miner-2", "validator"]
    assert roles_text(roles) == "chain, gateway, miner-1, miner-2, validator"
    assert roles_text(roles, fold_miners=True) == "chain, gateway, 2 miners, validator"
    assert roles_text(["miner"], fold_miners=True) == "miner"
    assert roles_text([]) == "no roles"


def test_fit_columns_leaves_out_the_named_columns_in_order_only_until_the_table_fits():
    rows = [
        (Cell("who"), Cell("load"), Cell("round"), Cell("served")),
        (Cell("miner-1"), Cell("—"), Cell("round 3 of 5"), Cell("19")),
    ]
    assert fit_columns(rows, None, drop=("load", "round")) == rows
    assert fit_columns(rows, 80, drop=("load", "round")) == rows
    # who 7 + load 4 + round 12 + served 6 + 3 gaps of 2 = 35: one column less fits 30.
    assert [cell.text for cell in fit_columns(rows, 30, drop=("load", "round"))[0]] == ["who", "round", "served"]
    assert [cell.text for cell in fit_columns(rows, 10, drop=("load", "round"))[0]] == ["who", "served"]


# ---- the app at 100 columns ---------------------------------------------------------------------


def cut_lines(app: App[None]) -> list[str]:
    """Lines of the visible tab's one-line-per-row widgets that are wider than their widget."""
    tabs = app.query(TabbedContent)
    pane = tabs.first().active_pane if tabs else app.screen
    assert pane is not None
    cut = []
    for static in pane.query(Static):
        if static.display and static.styles.text_wrap == "nowrap":
            cut += [line for line in str(static.render()).splitlines() if cell_len(line) > static.size.width]
    return cut


def test_every_tab_at_100_columns_has_a_one_line_header_whole_tables_and_a_readable_footer():
    from textual.widgets._footer import FooterKey

    async def scenario() -> None:
        app = NodeManager(None, clock=lambda: NOW)
        async with app.run_test(size=SIZE) as pilot:
            app.show_snapshot(node_snapshot(), events=EVENTS)
            for tab in TABS:
                await pilot.press(tab)
                await pilot.pause()
                assert app.query_one("#node-header", Static).size.height == 1, f"tab {tab}: the header wraps"
                assert not cut_lines(app), f"tab {tab}: lines cut at the edge: {cut_lines(app)}"
                keys = [key for key in app.screen.query(FooterKey) if key.display and key.action != "command_palette"]
                cut = [key.description for key in keys if key.region.right > SIZE[0] - len(" ^p palette ")]
                assert not cut, f"tab {tab}: the footer cuts {cut}"
                assert {"quit", "show_keys"} <= {key.action for key in keys}, f"tab {tab}: no q or ? in the footer"

    asyncio.run(scenario())


def test_the_tables_keep_their_key_columns_at_100_columns():
    async def scenario() -> None:
        app = NodeManager(None, clock=lambda: NOW)
        async with app.run_test(size=SIZE) as pilot:
            app.show_snapshot(node_snapshot(), events=EVENTS)
            await pilot.press("4")
            await pilot.pause()
            gateway = str(app.query_one("GatewayPanel #table", Static).render()).splitlines()
            assert gateway[0].split() == ["miner/worker", "state", "breaker", "(last", "60", "s", "/", "5", "min)"] + [
                "link",
                "served",
                "audited",
            ]
            assert gateway[1].split()[-2:] == ["19", "9"] and gateway[2].split()[-2:] == ["28", "14"]
            await pilot.press("6")
            await pilot.pause()
            gpus = str(app.query_one("GpuPanel #table", Static).render()).splitlines()
            assert gpus[0].split()[-1] == "throttle" and gpus[3].endswith("HW slowdown, HW thermal")
            await pilot.press("3")
            await pilot.pause()
            weights = app.query_one("#validator-weights", Static)
            assert weights.region.width == SIZE[0], "the validator's boxes stack rather than halve"

    asyncio.run(scenario())


def test_one_miners_boxes_stack_at_100_columns_and_only_its_command_and_log_tail_are_cut():
    """The command is copied whole with c, and the log tail is the Logs tab's; the rest stays."""
    app = Host(MinerPanel(), gpu_states(), names={"miner": HOME}, server_log={"model_server": READY_LOG})

    async def scenario() -> None:
        async with app.run_test(size=SIZE) as pilot:
            app.feed()
            await pilot.pause()
            assert app.query_one(".box.side.proofs").region.width == SIZE[0]
            assert [line.split(":")[0] for line in cut_lines(app)] == ["cmd", "log"]

    asyncio.run(scenario())


@pytest.mark.parametrize("size", [SIZE, (160, 45)])
def test_the_logs_tab_fills_the_screen_with_its_status_line_above_the_footer(size):
    async def scenario() -> None:
        app = NodeManager(None, clock=lambda: NOW)
        async with app.run_test(size=size) as pilot:
            app.show_snapshot(node_snapshot(), events=EVENTS)
            await pilot.press("7")
            await pilot.pause()
            status = app.query_one("#logs-status", Static)
            assert status.region.bottom == size[1] - 1, "the status line sits right above the footer"
            assert str(status.render()).startswith("3 lines")
            assert app.query_one("#node-header", Static).region.y == 0, "the header stays in view"

    asyncio.run(scenario())


def test_at_160_columns_nothing_is_left_out():
    async def scenario() -> None:
        app = NodeManager(None, clock=lambda: NOW)
        async with app.run_test(size=(160, 45)) as pilot:
            app.show_snapshot(node_snapshot(), events=EVENTS)
            assert "up 10 min" in str(app.query_one("#node-header", Static).render())
            await pilot.press("4")
            await pilot.pause()
            header = str(app.query_one("GatewayPanel #table", Static).render()).splitlines()[0]
            assert "load" in header and "qualifying round" in header and "in state" in header

    asyncio.run(scenario())


@pytest.mark.parametrize("tab", list(TABS))
def test_each_tab_at_100_columns(snap_compare, utc, tab):
    app = NodeManager(None, clock=lambda: NOW)

    async def show(pilot) -> None:
        app.show_snapshot(node_snapshot(), events=EVENTS)
        await pilot.press(tab)
        await pilot.pause()

    assert snap_compare(app, terminal_size=SIZE, run_before=show)
