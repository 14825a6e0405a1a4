"""Traffic eligibility: the traffic control plane's current state of each (miner, model), kept
so that a restarted gateway resumes where it was (a pulled miner stays pulled through its
cooldown) and the operator's tools can show it. `engy_node.gateway.trust.traffic` decides the states;
this only stores the latest.

Zero data retention (docs/reliability.md, "Data"). `reason` is the one free-text field: the control plane's own
sentence about a transition, made from codes and numbers, never a buyer's content. It is capped
at 500 characters and one printable line, which is what such a sentence needs and keeps a bug
from pouring anything larger onto the disk.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Literal

from engy_node.gateway.store.checks import catalog_id, identifier, timestamp
from engy_node.gateway.store.connection import Connection, serialised

MAX_REASON_CHARS = 500
"""Longest `EligibilityRow.reason`; the schema refuses longer ones too."""

_COLUMNS = ("miner", "model", "state", "reason", "since", "updated_at")


@dataclasses.dataclass(frozen=True, slots=True)
class EligibilityRow:
    """The state of one (miner, model), validated on construction."""

    miner: str
    """Hotkey or `key:<miner id>`."""
    model: str
    """Catalog id."""
    state: Literal["new", "probing", "active", "pulled"]
    reason: str
    """Why it is in this state, in words (the control plane's own text; see the module docstring)."""
    since: float
    """Unix seconds when it entered this state."""
    updated_at: float
    """Unix seconds when the control plane last wrote the row."""

    def __post_init__(self) -> None:
        identifier("miner", self.miner)
        catalog_id("model", self.model)
        if self.state not in ("new", "probing", "active", "pulled"):
            raise ValueError(f"state must be 'new', 'probing', 'active' or 'pulled', got {self.state!r}")
        if not isinstance(self.reason, str) or len(self.reason) > MAX_REASON_CHARS or not self.reason.isprintable():
            raise ValueError(
                f"reason must be one printable line of at most {MAX_REASON_CHARS} characters, got {self.reason!r}"
            )
        timestamp("since", self.since)
        timestamp("updated_at", self.updated_at)


class EligibilityTable(Connection):
    """Traffic eligibility on the store's connection."""

    @serialised
    def save_eligibility(self, rows: Sequence[EligibilityRow]) -> None:
        """Store each row as its (miner, model)'s current state, all in one transaction;
        (miner, model) pairs not among `rows` keep theirs."""
        for row in rows:
            if not isinstance(row, EligibilityRow):
                raise TypeError(f"save_eligibility takes EligibilityRow rows, got {type(row).__name__}")
        updates = ", ".join(f"{column} = excluded.{column}" for column in _COLUMNS[2:])
        with self._write() as conn:
            conn.executemany(
                f"INSERT INTO eligibility ({', '.join(_COLUMNS)}) VALUES ({', '.join('?' * len(_COLUMNS))}) "
                f"ON CONFLICT (miner, model) DO UPDATE SET {updates}",
                [[getattr(row, column) for column in _COLUMNS] for row in rows],
            )

    @serialised
    def eligibility(self) -> list[EligibilityRow]:
        """Every stored (miner, model) state, by miner then model."""
        with self._read() as conn:
            rows = conn.execute(f"SELECT {', '.join(_COLUMNS)} FROM eligibility ORDER BY miner, model").fetchall()
        return [EligibilityRow(*row) for row in rows]
