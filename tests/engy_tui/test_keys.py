"""The node manager's keys: `?`/F1 list every binding with its id (and close again), the Logs
tab's keys work as soon as it shows, and a search hands the number keys back to the tabs."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from textual.binding import Binding
from textual.pilot import Pilot
from textual.widgets import TabbedContent

from engy_tui.manager import NodeManager
from engy_tui.screens.keys import KeysScreen, key_groups, key_label
from engy_tui.widgets.logs import LogsView
from tests.engy_tui.test_manager_screens import EVENTS, node_snapshot
from tests.engy_tui.test_validator_panel import NOW

SIZE = (160, 45)


def drive(script: Callable[[Pilot, NodeManager], Awaitable[None]], *, keymap: dict[str, str] | None = None) -> None:
    app = NodeManager(None, clock=lambda: NOW, keymap=keymap)

    async def body() -> None:
        async with app.run_test(size=SIZE) as pilot:
            app.show_snapshot(node_snapshot(), events=EVENTS)
            await pilot.pause()
            await script(pilot, app)

    asyncio.run(body())


def active_tab(app: NodeManager) -> str:
    return app.query_one(TabbedContent).active


# ---- the keys panel -------------------------------------------------------------------------


def test_a_key_label_reads_as_typed():
    assert key_label("slash") == "/"
    assert key_label("question_mark,f1") == "? F1"
    assert key_label("end,G") == "end G"
    assert key_label("ctrl+p") == "ctrl+p"
    assert key_label("escape") == "esc"


def test_the_keys_list_every_binding_with_its_id_and_the_users_rebinding():
    groups = key_groups(
        [
            ("Everywhere", [Binding("q", "quit", "Quit", id="app.quit"), Binding("x", "mark", "Mark")]),
            ("Nowhere", [Binding("z", "nothing", "")]),
        ],
        {"app.quit": "ctrl+q"},
    )
    assert groups == [("Everywhere", [("ctrl+q", "Quit", "app.quit"), ("x", "Mark", "")])]


def test_question_mark_and_f1_open_the_keys_and_escape_or_question_mark_close_them():
    async def script(pilot: Pilot, app: NodeManager) -> None:
        for opener, closer in (("question_mark", "escape"), ("f1", "question_mark"), ("question_mark", "f1")):
            await pilot.press(opener)
            await pilot.pause()
            assert isinstance(app.screen, KeysScreen), f"{opener} did not open the keys"
            await pilot.press(closer)
            await pilot.pause()
            assert not isinstance(app.screen, KeysScreen), f"{closer} did not close the keys"
        # On the Logs tab too, where escape also closes a search.
        await pilot.press("7", "question_mark")
        await pilot.pause()
        assert isinstance(app.screen, KeysScreen)
        await pilot.press("escape")
        await pilot.pause()
        assert not isinstance(app.screen, KeysScreen)

    drive(script)


def test_the_keys_panel_shows_a_rebound_key(snap_compare, utc):
    app = NodeManager(None, clock=lambda: NOW, home="/srv/engy", keymap={"app.quit": "ctrl+q"})

    async def show(pilot) -> None:
        app.show_snapshot(node_snapshot(), events=EVENTS)
        await pilot.press("question_mark")
        await pilot.pause()

    assert snap_compare(app, terminal_size=SIZE, run_before=show)


# ---- the Logs tab ----------------------------------------------------------------------------


def test_the_logs_keys_work_as_soon_as_the_tab_shows():
    async def script(pilot: Pilot, app: NodeManager) -> None:
        logs = app.query_one(LogsView)
        await pilot.press("7")
        await pilot.pause()
        assert logs.follow
        await pilot.press("f")
        await pilot.pause()
        assert not logs.follow, "f did not reach the log on a freshly shown Logs tab"
        level = logs.buffer.filter.min_level
        await pilot.press("l")
        assert logs.buffer.filter.min_level != level

    drive(script)


def test_after_a_search_the_number_keys_switch_tabs_again():
    async def script(pilot: Pilot, app: NodeManager) -> None:
        logs = app.query_one(LogsView)
        await pilot.press("7", "slash", *"slow", "enter")
        await pilot.pause()
        assert logs.buffer.search is not None
        await pilot.press("2")
        await pilot.pause()
        assert active_tab(app) == "miner", "a submitted search kept the number keys"
        await pilot.press("7", "slash", *"x", "escape")
        await pilot.pause()
        await pilot.press("4")
        await pilot.pause()
        assert active_tab(app) == "gateway", "a cancelled search kept the number keys"
        await pilot.press("7", "n")  # and back on the Logs tab its keys still work
        await pilot.pause()
        assert app.focused is not None and logs in app.focused.ancestors_with_self

    drive(script)


# ---- the footer --------------------------------------------------------------------------------


def test_at_160_columns_the_footer_shows_every_key_of_every_tab():
    from textual.widgets._footer import FooterKey

    async def script(pilot: Pilot, app: NodeManager) -> None:
        for tab in "1234567":
            await pilot.press(tab)
            await pilot.pause()
            keys = [key for key in app.screen.query(FooterKey) if key.display and key.action != "command_palette"]
            assert keys
            # The palette's key sits at the right edge; the others must end before it.
            cut = [key.description for key in keys if key.region.right > SIZE[0] - len(" ^p palette ")]
            assert not cut, f"tab {tab}: the footer cuts {cut}"

    drive(script)
