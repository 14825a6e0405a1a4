"""What an NVIDIA Xid error means and what a miner should do about it: a pure table and the GPU
findings made from the Xids the monitor recorded (`engy_node.hardware.xid_events` receives them).

An Xid is the driver's report of a GPU fault (the kernel log's `NVRM: Xid (PCI:...): 79, ...`).
Some are the application's own fault (13, 31, 43, 45: a model server's bad kernel or a process
killed), some are the card's memory, firmware or bus failing (48, 64, 79, 95, ...). The table
says which, with the first thing to try, paraphrasing NVIDIA's Xid catalog; a number it does not
list still gets a finding, pointing at the catalog and the kernel log.

An Xid is an event, not a state: its finding holds for `XID_RECENT_S` after the GPU's last Xid,
so an alert about it fires once and recovers when the GPU has been quiet that long.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import NamedTuple

from engy_node.snapshots import Finding, Level, XidRecord

__all__ = ["XID_EXPLANATIONS", "XID_RECENT_S", "XidExplanation", "explain", "record_xid", "xid_findings"]

XID_RECENT_S = 3600.0
"""How long after a GPU's last Xid its finding (and alert) holds: long enough for an operator who
stepped away to see it in the TUI, short enough that a GPU quiet for an hour reads healthy."""

APP_FIX = (
    "check the model server's log for the CUDA error at that time; if it repeats across restarts, "
    "remove any GPU overclock and update the driver"
)
RESET_FIX = "reboot the machine to reset the GPU"
RMA_HINT = "if it comes back, the card's memory is failing: have it replaced"
CATALOG = "https://docs.nvidia.com/deploy/xid-errors/"


class XidExplanation(NamedTuple):
    what: str
    level: Level
    """`warning` for what the application or a restart clears, `error` for the card itself."""
    fix: str


XID_EXPLANATIONS: Mapping[int, XidExplanation] = {
    13: XidExplanation("graphics engine exception, usually the application's own fault", "warning", APP_FIX),
    31: XidExplanation(
        "GPU memory page fault (MMU fault), usually an illegal address in the application", "warning", APP_FIX
    ),
    43: XidExplanation(
        "GPU stopped processing: the driver stopped a faulting application, the GPU is still healthy",
        "warning",
        "no action unless it repeats; then " + APP_FIX,
    ),
    45: XidExplanation(
        "preemptive cleanup: the driver ended the GPU work of a stopped or killed process",
        "warning",
        "usually follows another Xid or a killed model server: look at the one before it",
    ),
    48: XidExplanation(
        "double-bit ECC error: memory corruption the GPU could not correct", "error", f"{RESET_FIX}; {RMA_HINT}"
    ),
    61: XidExplanation(
        "internal micro-controller breakpoint/warning", "error", f"{RESET_FIX}; update the driver if it repeats"
    ),
    62: XidExplanation(
        "internal micro-controller halted", "error", f"{RESET_FIX}; update the driver; repeated: a hardware fault"
    ),
    63: XidExplanation(
        "ECC page retirement or row remapping recorded: a bad memory row was found",
        "warning",
        f"reboot at a quiet time so the remapping takes effect; {RMA_HINT}",
    ),
    64: XidExplanation(
        "ECC page retirement or row remapping failed", "error", f"{RESET_FIX}; the card's memory is failing: replace it"
    ),
    74: XidExplanation(
        "NVLink error", "error", f"{RESET_FIX}; reseat the NVLink bridge; repeated: a link or hardware fault"
    ),
    79: XidExplanation(
        "GPU has fallen off the bus",
        "error",
        f"{RESET_FIX}; reseat the card and its riser, check its power cables and the PSU, and try a lower PCIe "
        "generation in the BIOS",
    ),
    92: XidExplanation(
        "high single-bit ECC error rate: the memory is wearing",
        "warning",
        "watch for Xid 48/63/64; plan to replace the card",
    ),
    94: XidExplanation(
        "contained ECC error: the affected application was stopped, other work goes on",
        "warning",
        "restart the model server; reboot at a quiet time to remap the bad memory",
    ),
    95: XidExplanation(
        "uncontained ECC error: all work on the GPU was stopped", "error", f"{RESET_FIX} now; {RMA_HINT}"
    ),
    119: XidExplanation(
        "GSP firmware did not answer (RPC timeout)",
        "error",
        f"{RESET_FIX}; update the driver; if it repeats, turn GSP firmware off (NVreg_EnableGpuFirmware=0) "
        "where the driver allows it",
    ),
    120: XidExplanation(
        "GSP firmware error",
        "error",
        f"{RESET_FIX}; update the driver; if it repeats, turn GSP firmware off (NVreg_EnableGpuFirmware=0) "
        "where the driver allows it",
    ),
}
"""The common Xids (NVIDIA's catalog, CATALOG, lists them all)."""


def explain(xid: int) -> XidExplanation:
    """`xid`'s explanation; one the table does not list points at the catalog and the kernel log."""
    known = XID_EXPLANATIONS.get(xid)
    if known is not None:
        return known
    return XidExplanation(
        "not one of the common ones",
        "warning",
        f"look it up in NVIDIA's Xid catalog ({CATALOG}) and read the kernel log around it (`sudo dmesg | grep -i xid`)",
    )


def record_xid(records: Mapping[int, XidRecord], gpu: int, xid: int, at: float) -> dict[int, XidRecord]:
    """`records` (by GPU) after GPU `gpu` reported `xid` at `at`."""
    before = records.get(gpu)
    after = dict(records)
    after[gpu] = XidRecord(gpu=gpu, xid=xid, at=at, count=1 if before is None else before.count + 1)
    return after


def xid_findings(records: Iterable[XidRecord], now: float, *, recent_s: float = XID_RECENT_S) -> tuple[Finding, ...]:
    """One finding per GPU whose last Xid came less than `recent_s` before `now`, by GPU."""
    findings = []
    for record in sorted(records, key=lambda r: r.gpu):
        if now - record.at >= recent_s:
            continue
        meaning = explain(record.xid)
        times = "" if record.count == 1 else f" ({record.count} Xids since the monitor started)"
        findings.append(
            Finding(
                record.gpu,
                "xid",
                meaning.level,
                f"GPU {record.gpu} reported Xid {record.xid}, {meaning.what}{times}: {meaning.fix}",
            )
        )
    return tuple(findings)
