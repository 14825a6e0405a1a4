"""The miner's tab: per miner of this node, is its model server serving (`serving`), does the
gateway route requests to it (`link`), is its work proven (`proofs`), and what is it earning on
chain (`earnings`)? One module per block, each answering that one question; `view` picks each
block's inputs out of the hub's states, `panel` is the widget, `common` the styles they share.

Shape, and why: what every line says and how it is styled is decided by plain functions over
the node's typed states (`engy_node.snapshots.NodeStates`, decoded once by the bridge), tested
without a terminal; the widget only turns their `Cell`s into Textual content. Each block module
says which producer publishes the fields it reads; read the producers before changing a field.

Honesty rules: a fact the hub did not give is "n/a", dimmed, never 0 (a component that did not
report is None; a field typed `int | None` is None when unknown); text and floats from the wire
are still read with the cells' readers (a control character, nan); colour is never the only
signal (✔ ✘ ⚠ and state words carry it), and every failure shown names its fix.
"""

from engy_tui.widgets.miner.panel import MinerPanel

__all__ = ["MinerPanel"]
