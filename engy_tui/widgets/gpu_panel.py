"""The GPUs panel: one row per GPU from the hub's "gpus" state, and under it the findings, each
with its fix.

The widget is handed the state (`GpusState`: the `GpuSample`s and `Finding`s that
`engy_node.hardware.monitor.run_gpu_monitor` publishes, decoded) and the render time through `update_state` by the app's fixed-rate timer; it never
polls or reads the clock. What every cell says and how it is styled is decided by the plain
functions below, tested without a terminal; the widget only turns their `Cell`s into Textual
content.

Honesty rules:

* A reading NVML did not give is "n/a", dimmed; never 0.
* Colour is never the only signal: a hot GPU says "hot", a link below its max carries "⚠", and
  the finding under the table says why and what to do. The temperature bands are
  `gpu_monitor.temperature_band`, the same ones the findings use.
* Readings older than `STALE_AFTER_S` are greyed out whole and the title says how old they are,
  so a stopped monitor cannot pass for a healthy GPU.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence

from rich.cells import cell_len
from textual.app import ComposeResult
from textual.content import Content
from textual.widget import Widget
from textual.widgets import Static

from engy_node.hardware.gpu import CPU_MODE, GIB
from engy_node.hardware.monitor import THROTTLE_LABELS, temperature_band
from engy_node.snapshots import Finding, GpuSample, GpusState
from engy_tui.widgets.cells import DASH, NA, Cell, cells_content, fit_columns, room

__all__ = [
    "COLUMNS",
    "STALE_AFTER_S",
    "STYLES",
    "Cell",
    "GpuPanel",
    "PanelView",
    "clocks_cell",
    "fan_cell",
    "finding_cell",
    "model_cell",
    "panel_view",
    "pcie_cell",
    "power_cell",
    "row_cells",
    "temperature_cell",
    "throttle_cell",
    "util_cell",
    "vram_cell",
]

WARN = "⚠"
ERROR = "✖"

STALE_AFTER_S = 5.0
"""Five missed rounds at the monitor's default 1 s interval: long enough that one slow NVML
round (a busy driver) does not flicker the panel grey, short enough to notice in a glance."""

COLUMNS = ("#", "model", "temp", "fan", "power", "VRAM", "util", "SM/mem MHz", "PCIe", "throttle")
GAP = "  "

STYLES: dict[str, str] = {
    "": "",
    "header": "bold $foreground-muted",
    "na": "$foreground-muted",
    "cool": "$text-success",
    "warm": "$text-warning",
    "hot": "$text-error",
    "limit": "bold $text-error",
    "warning": "$text-warning",
    "error": "bold $text-error",
    "stale": "$foreground-disabled",
}
"""Cell style names -> Textual styles (theme variables, so every theme works). Inside content
only plain colour variables resolve: `$text-muted` is a relative ("auto 60%") value that would
silently render as full white, hence `$foreground-muted`."""

TEMPERATURE_WORDS = {"cool": "", "warm": " warm", "hot": " hot", "limit": " limit"}


NA_CELL = Cell(NA, "na")


def model_cell(name: str | None) -> Cell:
    """The model without the brand words every row shares: "NVIDIA GeForce RTX 4090" -> "RTX 4090"."""
    if not name:
        return NA_CELL
    return Cell(name.removeprefix("NVIDIA ").removeprefix("GeForce "))


def temperature_cell(temperature_c: int | None, slowdown_c: int | None) -> Cell:
    """ "64°C" green, "71°C warm" yellow, "84°C hot" red, "88°C limit" bold red (bands from
    `gpu_monitor.temperature_band`)."""
    band = temperature_band(temperature_c, slowdown_c)
    if band is None:
        return NA_CELL
    return Cell(f"{temperature_c}°C{TEMPERATURE_WORDS[band]}", band)


def fan_cell(fan_percent: int | None) -> Cell:
    if fan_percent is None:
        return NA_CELL
    if fan_percent >= 100:
        return Cell(f"{fan_percent}% max", "warning")
    return Cell(f"{fan_percent}%")


def power_cell(draw_w: float | None, limit_w: float | None) -> Cell:
    """Draw against the enforced limit: "301/450 W"."""
    if draw_w is None:
        return NA_CELL
    if limit_w is None:
        return Cell(f"{draw_w:.0f} W")
    return Cell(f"{draw_w:.0f}/{limit_w:.0f} W")


def vram_cell(used_bytes: int | None, total_bytes: int | None) -> Cell:
    """Used of total in GiB, the unit NVML's sizes are round in: "21.9/24.0 GiB"."""
    if used_bytes is None:
        return NA_CELL
    if total_bytes is None:
        return Cell(f"{used_bytes / GIB:.1f} GiB")
    return Cell(f"{used_bytes / GIB:.1f}/{total_bytes / GIB:.1f} GiB")


def util_cell(percent: int | None) -> Cell:
    return NA_CELL if percent is None else Cell(f"{percent}%")


def clocks_cell(sm_mhz: int | None, mem_mhz: int | None) -> Cell:
    """Current SM and memory clocks: "2520/10501"; a missing one reads n/a in its place."""
    if sm_mhz is None and mem_mhz is None:
        return NA_CELL
    return Cell(f"{NA if sm_mhz is None else sm_mhz}/{NA if mem_mhz is None else mem_mhz}")


def pcie_cell(gen: int | None, width: int | None, *, flagged: bool) -> Cell:
    """The link as it runs now, "4.0 x16"; `flagged` (a `pcie` finding: below its max where that
    matters) adds "⚠". An idle card's lower generation is normal and not flagged."""
    if gen is None and width is None:
        return NA_CELL
    text = f"{'?' if gen is None else f'{gen}.0'} x{'?' if width is None else width}"
    return Cell(f"{text} {WARN}", "warning") if flagged else Cell(text)


def throttle_cell(reasons: Sequence[str] | None, *, flagged: bool) -> Cell:
    """Why clocks are held back, in short words; "—" for nothing, "idle" (dimmed) for an idle
    card. `flagged` (a `throttling` finding) styles it as a warning."""
    if reasons is None:
        return NA_CELL
    if not reasons:
        return Cell(DASH)
    active = [r for r in reasons if r != "gpu_idle"]
    if not active:
        return Cell(THROTTLE_LABELS["gpu_idle"], "na")
    text = ", ".join(THROTTLE_LABELS.get(r, r) for r in active)
    return Cell(text, "warning" if flagged else "")


def row_cells(sample: GpuSample, flagged: Iterable[str] = ()) -> tuple[Cell, ...]:
    """One GPU's row, in `COLUMNS` order. `flagged`: the kinds of this GPU's findings."""
    kinds = set(flagged)
    return (
        Cell(str(sample.index), "error" if sample.lost else ""),
        model_cell(sample.name),
        temperature_cell(sample.temperature_c, sample.temperature_slowdown_c),
        fan_cell(sample.fan_percent),
        power_cell(sample.power_draw_w, sample.power_limit_w),
        vram_cell(sample.memory_used_bytes, sample.memory_total_bytes),
        util_cell(sample.gpu_util_percent),
        clocks_cell(sample.sm_clock_mhz, sample.mem_clock_mhz),
        pcie_cell(sample.pcie_gen, sample.pcie_width, flagged="pcie" in kinds),
        throttle_cell(sample.clock_event_reasons, flagged="throttling" in kinds),
    )


def finding_cell(finding: Finding) -> Cell:
    """ "⚠ GPU 1 runs at PCIe x8 (max x16): check the riser/slot"; errors get "✖"."""
    if finding.level == "error":
        return Cell(f"{ERROR} {finding.text}", "error")
    return Cell(f"{WARN} {finding.text}", "warning")


@dataclasses.dataclass(frozen=True, slots=True)
class PanelView:
    """Everything the panel shows for one state at one time."""

    title: str
    stale_s: float | None
    """How old the readings are when older than `STALE_AFTER_S`, else None."""
    status: tuple[Cell, ...]
    """Lines above the table: waiting, CPU mode, or why the last reading failed."""
    table: tuple[tuple[Cell, ...], ...]
    """Header and one row per GPU, cells padded to their column's width; empty with no GPU."""
    findings: tuple[Cell, ...]


NARROW_DROPS = ("SM/mem MHz", "util", "fan", "PCIe", "power")
"""The columns a narrow terminal leaves out, first to last; each one's warnings are still in the
findings below the table. The temperature, VRAM and throttle reasons stay whole."""


def panel_view(state: GpusState | None, now: float, *, width: int | None = None) -> PanelView:
    """What the panel shows for the hub's "gpus" state (None: the monitor has not reported) at
    wall-clock time `now`; `width`: the cells a line has (the table leaves out `NARROW_DROPS`
    until it fits), None for every column."""
    if state is None:
        return PanelView("GPUs", None, (Cell("waiting for the first GPU reading", "na"),), (), ())
    reason = state.reason
    if reason:
        # gpu.detect's reasons end in "running in CPU mode", which this line already says.
        return PanelView(
            "GPUs", None, (Cell(f"no NVIDIA GPU — CPU mode: {reason.removesuffix(f': {CPU_MODE}')}"),), (), ()
        )
    samples, findings = state.samples, state.findings
    status = (Cell(f"{ERROR} {state.error}", "error"),) if state.error else ()
    if not samples:
        return PanelView("GPUs", None, status or (Cell("waiting for the first GPU reading", "na"),), (), ())
    kinds: dict[int, set[str]] = {}
    for finding in findings:
        kinds.setdefault(finding.gpu, set()).add(finding.kind)
    table = _pad(
        fit_columns(
            [tuple(Cell(name, "header") for name in COLUMNS)]
            + [row_cells(sample, kinds.get(sample.index, ())) for sample in samples],
            width,
            drop=NARROW_DROPS,
        )
    )
    notes = tuple(finding_cell(f) for f in findings)
    sampled_at = state.sampled_at
    age = None if sampled_at is None else now - sampled_at
    if age is None or age <= STALE_AFTER_S:
        return PanelView(f"GPUs · {len(samples)}", None, status, table, notes)
    return PanelView(
        f"GPUs · {len(samples)} · stale {age:.0f} s", age, status, tuple(_grey(row) for row in table), _grey(notes)
    )


def _grey(cells: Iterable[Cell]) -> tuple[Cell, ...]:
    # Keep the words and symbols, drop the colours: they would claim the GPU is like that now.
    return tuple(cell._replace(style="stale") for cell in cells)


def _pad(rows: list[tuple[Cell, ...]]) -> tuple[tuple[Cell, ...], ...]:
    """Pad every cell to its column's widest text plus the gap (none after the last column)."""
    widths = [max(cell_len(row[column].text) for row in rows) for column in range(len(rows[0]))]
    last = len(rows[0]) - 1
    return tuple(
        tuple(
            cell
            if column == last
            else cell._replace(text=cell.text + " " * (widths[column] - cell_len(cell.text)) + GAP)
            for column, cell in enumerate(row)
        )
        for row in rows
    )


def _content(lines: Iterable[Sequence[Cell]]) -> Content:
    return cells_content(lines, STYLES)


class GpuPanel(Widget):
    """The GPUs table; call `update_state(state, now)` to show a new hub snapshot."""

    DEFAULT_CSS = """
    GpuPanel {
        height: auto;
        padding: 0 1;
        border: round $primary;
        border-title-color: $text-primary;
        border-title-style: bold;
    }
    GpuPanel.-stale {
        border: round $foreground-darken-3;
        border-title-color: $text-warning;
    }
    GpuPanel > #table {
        text-wrap: nowrap;
        text-overflow: ellipsis;
    }
    """

    _shown: tuple[GpusState | None, float] = (None, 0.0)
    """What `update_state` was last given, to lay out again for a new width."""

    def compose(self) -> ComposeResult:
        yield Static(id="status")
        yield Static(id="table")
        yield Static(id="findings")

    def on_mount(self) -> None:
        self.update_state(None, 0.0)

    def on_resize(self) -> None:
        # Another width: the table keeps or leaves out its narrow-terminal columns.
        self.update_state(*self._shown)

    def update_state(self, state: GpusState | None, now: float) -> None:
        """Show the hub's "gpus" state (None: nothing published yet) as of wall-clock `now`."""
        self._shown = (state, now)
        view = panel_view(state, now, width=room(self))
        self.border_title = view.title
        self.set_class(view.stale_s is not None, "-stale")
        for widget_id, lines in (
            ("status", [(c,) for c in view.status]),
            ("table", view.table),
            ("findings", [(c,) for c in view.findings]),
        ):
            static = self.query_one(f"#{widget_id}", Static)
            static.update(_content(lines))
            static.display = bool(lines)
