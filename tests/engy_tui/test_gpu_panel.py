"""The GPUs panel: every cell's text and style as plain functions, the view of a whole state
(CPU mode, waiting, stale, failed), the widget under Pilot and one SVG snapshot per look.

The state comes from the same pipeline as in the node: `sample` and `assess` over the fake rig
of `tests/engy_node/hardware/test_monitor.py` (4x RTX 4090 + 1x RTX 5090, one on a x8 riser, one
throttling, one without a fan reading), published as plain dicts and decoded strictly into the
`GpusState` the panel reads (`snapshots.decode_states`), so a fixture cannot use a field the
schema lacks. Pilot tests are plain
functions driving the app with `asyncio.run`, as in `test_app.py` (pytest-trio claims `async def`
tests).
"""

from __future__ import annotations

import asyncio

import pytest
from textual.app import App, ComposeResult
from textual.widgets import Static

from engy_node.hardware.gpu import GIB
from engy_node.hardware.monitor import assess, sample
from engy_node.hardware.xids import explain, xid_findings
from engy_node.snapshots import Finding, GpuSample, GpusState, XidRecord, decode_states
from engy_tui.widgets.gpu_panel import (
    COLUMNS,
    STALE_AFTER_S,
    STYLES,
    Cell,
    GpuPanel,
    clocks_cell,
    fan_cell,
    finding_cell,
    model_cell,
    panel_view,
    pcie_cell,
    power_cell,
    row_cells,
    temperature_cell,
    throttle_cell,
    util_cell,
    vram_cell,
)
from tests.engy_node.hardware.test_monitor import rig

SAMPLED_AT = 1_000_000.0
SIZE = (120, 16)
CPU_REASON = "no NVIDIA driver found (libnvidia-ml.so not loadable): running in CPU mode"


def rig_state() -> dict:
    api = rig()
    api.init()
    samples = sample(api)
    return {
        "samples": [s.as_dict() for s in samples],
        "findings": [f.as_dict() for f in assess(samples)],
        "reason": None,
        "error": None,
        "sampled_at": SAMPLED_AT,
    }


def gpus(state: dict) -> GpusState:
    """The hub's "gpus" state as the panel gets it: decoded (strictly: the fixture must fit the schema)."""
    decoded = decode_states({"gpus": state}, strict=True).gpus
    assert decoded is not None
    return decoded


def text(line: tuple[Cell, ...]) -> str:
    return "".join(cell.text for cell in line).rstrip()


# ---- cells --------------------------------------------------------------------------------------


def test_every_style_a_cell_can_have_is_defined():
    assert {"", "na", "cool", "warm", "hot", "limit", "warning", "error", "header", "stale"} <= set(STYLES)


def test_the_model_drops_the_brand_words_every_row_shares():
    assert model_cell("NVIDIA GeForce RTX 4090") == Cell("RTX 4090")
    assert model_cell("NVIDIA H200") == Cell("H200")
    assert model_cell(None) == Cell("n/a", "na")


@pytest.mark.parametrize(
    ("temperature", "slowdown", "cell"),
    [
        (64, 87, Cell("64°C", "cool")),
        (71, 87, Cell("71°C warm", "warm")),
        (84, 87, Cell("84°C hot", "hot")),
        (88, 87, Cell("88°C limit", "limit")),
        (86, None, Cell("86°C hot", "hot")),
        (None, 87, Cell("n/a", "na")),
    ],
)
def test_temperature_has_a_colour_and_a_word_from_its_distance_to_slowdown(temperature, slowdown, cell):
    assert temperature_cell(temperature, slowdown) == cell


def test_fan_says_max_at_full_speed():
    assert (fan_cell(48), fan_cell(100), fan_cell(None)) == (
        Cell("48%"),
        Cell("100% max", "warning"),
        Cell("n/a", "na"),
    )


def test_power_is_draw_against_limit_and_n_a_without_a_draw():
    assert power_cell(301.4, 450.0) == Cell("301/450 W")
    assert power_cell(301.4, None) == Cell("301 W")
    assert power_cell(None, 450.0) == Cell("n/a", "na")


def test_vram_is_used_of_total_in_gib():
    assert vram_cell(int(21.9 * GIB), 24 * GIB) == Cell("21.9/24.0 GiB")
    assert vram_cell(int(21.9 * GIB), None) == Cell("21.9 GiB")
    assert vram_cell(None, 24 * GIB) == Cell("n/a", "na")


def test_util_and_clocks_show_n_a_for_what_is_missing_never_zero():
    assert (util_cell(93), util_cell(0), util_cell(None)) == (Cell("93%"), Cell("0%"), Cell("n/a", "na"))
    assert clocks_cell(2520, 10501) == Cell("2520/10501")
    assert clocks_cell(None, 10501) == Cell("n/a/10501")
    assert clocks_cell(None, None) == Cell("n/a", "na")


def test_pcie_shows_the_link_and_marks_it_only_when_flagged():
    assert pcie_cell(4, 16, flagged=False) == Cell("4.0 x16")
    assert pcie_cell(4, 8, flagged=True) == Cell("4.0 x8 ⚠", "warning")
    assert pcie_cell(None, 16, flagged=False) == Cell("? x16")
    assert pcie_cell(None, None, flagged=False) == Cell("n/a", "na")


@pytest.mark.parametrize(
    ("reasons", "flagged", "cell"),
    [
        ([], False, Cell("—")),
        (["gpu_idle"], False, Cell("idle", "na")),
        (["gpu_idle", "sw_power_cap"], False, Cell("power cap")),
        (["hw_slowdown", "hw_thermal"], True, Cell("HW slowdown, HW thermal", "warning")),
        (["0x80000"], False, Cell("0x80000")),
        (None, False, Cell("n/a", "na")),
    ],
)
def test_throttle_reasons_are_short_words(reasons, flagged, cell):
    assert throttle_cell(reasons, flagged=flagged) == cell


def test_findings_carry_a_symbol_as_well_as_a_colour():
    assert finding_cell(Finding(0, "pcie", "warning", "x")) == Cell("⚠ x", "warning")
    assert finding_cell(Finding(0, "lost", "error", "y")) == Cell("✖ y", "error")


def test_a_lost_gpus_row_is_all_n_a_with_its_index_marked():
    row = row_cells(GpuSample(3, errors=("handle (GPU is lost)",), lost=True), {"lost"})
    assert len(row) == len(COLUMNS)
    assert row[0] == Cell("3", "error")
    assert all(cell == Cell("n/a", "na") for cell in row[1:])


# ---- the view of a state ------------------------------------------------------------------------


def test_the_rig_is_a_table_with_its_findings_under_it():
    view = panel_view(gpus(rig_state()), SAMPLED_AT + 1)

    assert view.title == "GPUs · 5" and view.stale_s is None and view.status == ()
    lines = [text(line) for line in view.table]
    assert lines[0].split() == [
        "#",
        "model",
        "temp",
        "fan",
        "power",
        "VRAM",
        "util",
        "SM/mem",
        "MHz",
        "PCIe",
        "throttle",
    ]
    assert lines[1] == "0  RTX 4090  64°C        48%       301/450 W  21.9/24.0 GiB  93%   2520/10501  4.0 x16   —"
    assert "4.0 x8 ⚠" in lines[2] and "71°C warm" in lines[2]
    assert "88°C limit" in lines[3] and "100% max" in lines[3] and lines[3].endswith("HW slowdown, HW thermal")
    assert lines[4].split()[4] == "n/a", "GPU 3's fan is not reported"
    assert "RTX 5090" in lines[5] and "5.0 x16" in lines[5]
    pcie_at = lines[0].index("PCIe")
    assert all(line[pcie_at:].startswith(("4.0 x", "5.0 x")) for line in lines[1:]), "columns line up"
    assert [c.text for c in view.findings] == [
        "⚠ GPU 1 runs at PCIe x8 (max x16): check the riser/slot; tensor-parallel all-reduce is slower through it",
        "⚠ GPU 2 is throttling: HW slowdown, HW thermal (temperature 88°C ≥ 87°C slowdown): improve cooling "
        "(case airflow, dust, fan curve) or lower the power limit",
        "⚠ GPU 2's fan runs at 100%: it cannot cool any harder; improve case airflow or lower the power limit",
    ]


def test_only_the_cells_a_finding_is_about_are_marked():
    rows = panel_view(gpus(rig_state()), SAMPLED_AT).table
    pcie, throttle = COLUMNS.index("PCIe"), COLUMNS.index("throttle")
    assert rows[2][pcie].style == "warning" and rows[1][pcie].style == ""
    assert rows[3][throttle].style == "warning" and rows[1][throttle].style == ""


def test_readings_older_than_the_limit_are_greyed_out_and_say_how_old():
    state = gpus(rig_state())
    fresh = panel_view(state, SAMPLED_AT + STALE_AFTER_S)
    stale = panel_view(state, SAMPLED_AT + 12.4)

    assert fresh.stale_s is None
    assert stale.title == "GPUs · 5 · stale 12 s"
    assert {cell.style for line in stale.table for cell in line} == {"stale"}
    assert {cell.style for cell in stale.findings} == {"stale"}
    assert [text(line) for line in stale.table] == [text(line) for line in fresh.table], "the words stay"


def test_without_a_gpu_the_panel_says_cpu_mode_and_why():
    view = panel_view(
        gpus({"samples": [], "findings": [], "reason": CPU_REASON, "error": None, "sampled_at": 0.0}), 999.0
    )
    assert view.status == (Cell("no NVIDIA GPU — CPU mode: no NVIDIA driver found (libnvidia-ml.so not loadable)"),)
    assert view.table == () and view.findings == () and view.stale_s is None


def test_before_the_first_reading_the_panel_says_it_is_waiting():
    assert panel_view(None, 0.0).status == (Cell("waiting for the first GPU reading", "na"),)
    assert panel_view(gpus({}), 0.0).status == (Cell("waiting for the first GPU reading", "na"),)


def test_a_failed_reading_is_shown_above_the_last_good_table():
    state = rig_state() | {"error": "GPU readings failed (NVMLError_Unknown: Unknown Error)"}
    view = panel_view(gpus(state), SAMPLED_AT)
    assert view.status == (Cell("✖ GPU readings failed (NVMLError_Unknown: Unknown Error)", "error"),)
    assert len(view.table) == 6
    never = {"samples": [], "findings": [], "reason": None, "error": "GPU readings failed (x)", "sampled_at": None}
    assert panel_view(gpus(never), 0.0).status == (Cell("✖ GPU readings failed (x)", "error"),)


# ---- the widget ---------------------------------------------------------------------------------


class PanelApp(App[None]):
    """Just the panel, showing one state at one time."""

    def __init__(self, state: dict | None, now: float) -> None:
        super().__init__()
        self.state, self.now = state, now

    def compose(self) -> ComposeResult:
        yield GpuPanel()

    def on_mount(self) -> None:
        self.query_one(GpuPanel).update_state(None if self.state is None else gpus(self.state), self.now)


def shown(app: App, widget_id: str) -> str:
    return str(app.query_one(f"#{widget_id}", Static).content)


def test_the_widget_renders_the_table_and_follows_new_states():
    async def scenario() -> None:
        app = PanelApp(None, 0.0)
        async with app.run_test(size=SIZE) as pilot:
            panel = app.query_one(GpuPanel)
            assert shown(app, "status") == "waiting for the first GPU reading"
            assert not app.query_one("#table").display

            panel.update_state(gpus(rig_state()), SAMPLED_AT + 1)
            await pilot.pause()
            assert panel.border_title == "GPUs · 5"
            assert not app.query_one("#status").display
            table = shown(app, "table").splitlines()
            assert len(table) == 6 and table[0].startswith("#  model")
            assert "4.0 x8 ⚠" in table[2]
            assert shown(app, "findings").splitlines()[0].startswith("⚠ GPU 1 runs at PCIe x8 (max x16)")

            panel.update_state(gpus(rig_state()), SAMPLED_AT + 30)
            await pilot.pause()
            assert panel.border_title == "GPUs · 5 · stale 30 s" and panel.has_class("-stale")

            panel.update_state(
                gpus({"samples": [], "findings": [], "reason": CPU_REASON, "error": None, "sampled_at": 0.0}), 0.0
            )
            await pilot.pause()
            assert shown(app, "status").startswith("no NVIDIA GPU — CPU mode: no NVIDIA driver found")
            assert not app.query_one("#table").display and not app.query_one("#findings").display
            assert not panel.has_class("-stale")

    asyncio.run(scenario())


def test_rig_snapshot(snap_compare):
    assert snap_compare(PanelApp(rig_state(), SAMPLED_AT + 1), terminal_size=SIZE)


def test_stale_rig_snapshot(snap_compare):
    assert snap_compare(PanelApp(rig_state(), SAMPLED_AT + 12), terminal_size=SIZE)


def test_cpu_mode_snapshot(snap_compare):
    state = {"samples": [], "findings": [], "reason": CPU_REASON, "error": None, "sampled_at": 0.0}
    assert snap_compare(PanelApp(state, 0.0), terminal_size=(100, 5))


def test_an_xid_is_a_finding_under_the_table_with_its_meaning_and_fix():
    state = rig_state()
    record = XidRecord(gpu=4, xid=79, at=SAMPLED_AT - 30)
    state["xids"] = [record.as_dict()]
    state["findings"] += [f.as_dict() for f in xid_findings([record], SAMPLED_AT)]
    view = panel_view(gpus(state), SAMPLED_AT + 1)
    assert view.findings[-1] == Cell(f"✖ GPU 4 reported Xid 79, GPU has fallen off the bus: {explain(79).fix}", "error")
