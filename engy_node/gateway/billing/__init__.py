"""Money: what a buyer's request costs, and what each epoch's traffic earns the miners.

`billing.py` decides a request's hold, charge and billable usage; `orphans.py` finds the holds a
dead worker process left open, to give back; `deposits.py` decides which TAO transfers to the
deposit address to credit, and `deposit_watcher.py` reads them from the chain. Per epoch, `epochs.py` says when it closes and what
its signed result holds, `settlement.py` turns its request log and verdicts into per-miner scores
and weights, and `publisher.py` closes, signs and stores it (docs/billing.md, docs/trust.md).
`billing.py`, `settlement.py` and most of `epochs.py` are pure integer arithmetic, so anyone can
recompute what was charged and what was published. The ledger itself is the store's
(`gateway/store/ledger.py`).
"""
