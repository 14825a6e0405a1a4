"""The dev chain's Balances pallet: free balances, `transfer_keep_alive` / `transfer_allow_death`,
and what a block that applied one holds (its extrinsics and `System.Events`), in the shapes the
SDK decodes from a node.

Why the dev chain has balances. A gateway credits buyers for TAO they transfer to its deposit
address (`gateway/billing/deposits.py`); the local network and the tests need the real SDK to
sign such a transfer (`bt.Transfer`) and the gateway to find it the way it finds one on finney:
by reading each block's header and its `System.Events` (`Balances.Transfer {from, to, amount}`
with the `extrinsic_idx` of the extrinsic that made it). So the dev chain keeps, per block with
an extrinsic, the decoded extrinsics and the events, for the last `BLOCK_HISTORY` such blocks
(an archive node keeps them all; a light one prunes too).

The rules are the pallet's, minus fees (the dev chain charges none, as its `estimate_fee` says):
an amount above the free balance fails `InsufficientBalance`; a transfer leaving the sender
below the existential deposit fails `Expendability` with keep-alive and reaps the account
without; a new account credited less than the existential deposit fails `ExistentialDeposit`.
A failed extrinsic is still in its block, with `System.ExtrinsicFailed` and no transfer event,
as on the chain. Accounts are created only by `fund` (the dev chain's genesis endowment).

Plain data, no lock, clock or SDK: `devchain.DevChain` calls this with its lock held.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from bittensor.result import ChainError

PALLET = "Balances"
TRANSFER_CALLS = frozenset({(PALLET, "transfer_keep_alive"), (PALLET, "transfer_allow_death")})

EXISTENTIAL_DEPOSIT_RAO = 500
"""Subtensor's `ExistentialDeposit` (500 rao)."""

BLOCK_HISTORY = 4096
"""Blocks with extrinsics whose contents and events the dev chain keeps (older ones read empty)."""

EXTRINSIC_INDEX = 1
"""The timestamp inherent is extrinsic 0 of every block; the one signed extrinsic a sealed block
carries is extrinsic 1 (`devchain.EXTRINSIC_INDEX`)."""


@dataclass
class Balances:
    """Free balances in rao, and the extrinsics and events of recent blocks that applied one."""

    free: dict[str, int] = field(default_factory=dict)
    blocks: dict[int, dict[str, Any]] = field(default_factory=dict)
    """block -> {"extrinsics": [decoded extrinsic], "events": [decoded event record]}"""

    def fund(self, address: str, rao: int) -> int:
        """Add `rao` to `address` (genesis endowment); returns its new free balance."""
        if rao < 0:
            raise ValueError(f"an endowment must be >= 0 rao, got {rao!r}")
        self.free[address] = self.free.get(address, 0) + rao
        return self.free[address]

    def transfer(self, block: int, signer: str, function: str, params: dict[str, Any]) -> str | None:
        """Apply one transfer call at `block` and record it; the pallet's error name, or None."""
        dest, value = str(params["dest"]), int(params["value"])
        error = self._check(signer, dest, value, keep_alive=function == "transfer_keep_alive")
        events: list[dict[str, Any]] = []
        if error is None:
            remaining = self.free.get(signer, 0) - value
            if remaining < EXISTENTIAL_DEPOSIT_RAO:
                self.free.pop(signer, None)  # reaped (allow_death only: keep-alive refused above)
            else:
                self.free[signer] = remaining
            self.free[dest] = self.free.get(dest, 0) + value
            events.append(_event(PALLET, "Transfer", {"from": signer, "to": dest, "amount": value}))
            events.append(_event("System", "ExtrinsicSuccess", {"dispatch_info": {}}))
        else:
            failure = {"dispatch_error": {"Module": _error_index(error)}, "dispatch_info": {}}
            events.append(_event("System", "ExtrinsicFailed", failure))
        self._record(block, signer, function, params, events)
        return error

    def record_other(self, block: int, signer: str, module: str, function: str, ok: bool) -> None:
        """Record a non-balance extrinsic (a weight set) so the block's contents are whole."""
        outcome = "ExtrinsicSuccess" if ok else "ExtrinsicFailed"
        self._record(block, signer, function, {}, [_event("System", outcome, {})], module=module)

    def _check(self, signer: str, dest: str, value: int, *, keep_alive: bool) -> str | None:
        free = self.free.get(signer, 0)
        if value > free:
            return "InsufficientBalance"
        if keep_alive and free - value < EXISTENTIAL_DEPOSIT_RAO:
            return "Expendability"
        if dest != signer and self.free.get(dest, 0) + value < EXISTENTIAL_DEPOSIT_RAO:
            return "ExistentialDeposit"
        return None

    def _record(
        self,
        block: int,
        signer: str,
        function: str,
        params: dict[str, Any],
        events: list[dict[str, Any]],
        *,
        module: str = PALLET,
    ) -> None:
        args = [{"name": name, "value": value} for name, value in params.items()]
        extrinsic = {"address": signer, "call": {"call_module": module, "call_function": function, "call_args": args}}
        for event in events:
            event["extrinsic_idx"] = EXTRINSIC_INDEX
            event["phase"] = {"ApplyExtrinsic": EXTRINSIC_INDEX}
        self.blocks[block] = {"extrinsics": [extrinsic], "events": events}
        while len(self.blocks) > BLOCK_HISTORY:
            del self.blocks[min(self.blocks)]

    def extrinsics(self, block: int, timestamp_ms: int) -> list[dict[str, Any]]:
        """The block's decoded extrinsics: the timestamp inherent, then any signed one."""
        inherent = {
            "call": {
                "call_module": "Timestamp",
                "call_function": "set",
                "call_args": [{"name": "now", "value": timestamp_ms}],
            }
        }
        return [inherent, *self.blocks.get(block, {}).get("extrinsics", [])]

    def events(self, block: int) -> list[dict[str, Any]]:
        """The block's decoded `System.Events` records (copies)."""
        return [dict(event) for event in self.blocks.get(block, {}).get("events", [])]

    def account(self, address: str) -> dict[str, Any]:
        """`System.Account` for `address`, as the SDK decodes it."""
        data = {"free": self.free.get(address, 0), "reserved": 0, "frozen": 0, "flags": 0}
        return {"nonce": 0, "consumers": 0, "providers": 1, "sufficients": 0, "data": data}

    def to_document(self) -> dict[str, Any]:
        return {"free": dict(self.free), "blocks": {str(block): record for block, record in self.blocks.items()}}

    @classmethod
    def from_document(cls, document: dict[str, Any] | None) -> Balances:
        """What `to_document` wrote; None (a file from before balances) is an empty pallet."""
        if not document:
            return cls()
        free = {str(address): int(rao) for address, rao in document.get("free", {}).items()}
        blocks = {int(block): record for block, record in document.get("blocks", {}).items()}
        return cls(free=free, blocks=blocks)


def dispatch_error(name: str) -> ChainError:
    """The ChainError the SDK builds for a failed dispatch of the Balances error `name`."""
    from bittensor.result import chain_error_from_dispatch

    return chain_error_from_dispatch({"Module": _error_index(name)})


@functools.cache
def _error_index(name: str) -> dict[str, int]:
    from bittensor._generated.errors import ERRORS

    for (pallet_index, error_index), info in ERRORS.items():
        if info.pallet == PALLET and info.name == name:
            return {"index": pallet_index, "error": error_index}
    raise KeyError(f"{PALLET} has no error named {name}")


def _event(module: str, event: str, attributes: dict[str, Any]) -> dict[str, Any]:
    return {"event": {"module_id": module, "event_id": event, "attributes": attributes}, "topics": []}
