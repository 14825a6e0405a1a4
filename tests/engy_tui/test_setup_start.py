"""`engy-tui --setup` after the wizard (issue 34): Esc on the first screen quits saying nothing
was written, and Esc from the palette's wizard goes back to the manager.

Pilot tests are plain functions driving the app with `asyncio.run`, as in test_manager.py.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from engy_tui.app import build_app
from engy_tui.manager import NodeManager
from engy_tui.screens.setup import SetupScreen, open_setup

SIZE = (130, 40)
WAIT_S = 20.0


async def wait_for(pilot, condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, f"not {what} within {WAIT_S} s"
        await pilot.pause(0.05)


# ---- Esc ----------------------------------------------------------------------------------------


def test_esc_in_the_first_run_wizard_quits_saying_nothing_was_written(tmp_path):
    app = build_app(["--home", str(tmp_path), "--setup"])

    async def scenario() -> None:
        async with app.run_test(size=SIZE) as pilot:
            await wait_for(pilot, lambda: isinstance(app.screen, SetupScreen), "the wizard open")
            await pilot.press("escape")
            await wait_for(pilot, lambda: app.return_code is not None, "quit")

    asyncio.run(scenario())
    assert app.farewell == (
        "engy-tui: setup closed without writing node.toml; nothing was started. "
        "Run `engy-tui --setup` again when ready, or `engy-tui --local` to try a local network first."
    )
    assert not (tmp_path / "node.toml").exists()


def test_esc_in_the_palettes_wizard_goes_back_to_the_manager(tmp_path):
    app = NodeManager(None, home=str(tmp_path))

    async def scenario() -> None:
        async with app.run_test(size=SIZE) as pilot:
            await open_setup(app, home=str(tmp_path))
            await wait_for(pilot, lambda: isinstance(app.screen, SetupScreen), "the wizard open")
            await pilot.press("escape")
            await wait_for(pilot, lambda: not isinstance(app.screen, SetupScreen), "the wizard closed")
            assert app.screen is app.screen_stack[0] and app.return_code is None

    asyncio.run(scenario())
