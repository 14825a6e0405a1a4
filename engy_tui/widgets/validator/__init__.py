"""The validator's tab (weights on chain, next action, warnings, submissions) and the chain tab
(every neuron of the subnet and the weights each validator has on chain).

One module per block, each answering one question: `weights` (which weights does the chain hold
from this validator?), `next_action` (what does it do next, and when?), `findings` (what must
the operator act on?), `submissions` (did its submissions land?), and `chain` (who is on the
subnet, and whose weights does the chain hold?). `standing` is where the validator stands on
chain, which three of the blocks ask; `common` the styles and table layout the blocks share;
`view` puts the validator's blocks together; `panel` holds the two widgets.

Shape, and why: what every line says and how it is styled is decided by plain functions over
the hub's states as `engy_node.snapshots` types them (`ValidatorState`, from
`engy_node.validator.light` and `role`; `ChainState`, from `engy_node.local.up._chain_snapshot`;
and the node's `hotkeys` {name: ss58}), tested without a terminal; the widgets only turn their
`Cell`s into Textual content.

Honesty rules:

* Anything the node did not report (a missing field, None, a value of the wrong type, which
  decoding turns into the field's default) is "n/a", dimmed; never a 0, and no function here
  raises on a state decoded from a malformed document.
* Colour is never the only signal: ✔ ✘ ⚠ and words say it, and every warning names its fix.
* Block counts use the freshest head block at hand (see `standing`), and say "~" when they are
  an estimate.
"""

from engy_tui.widgets.validator.panel import ChainPanel, ValidatorPanel

__all__ = ["ChainPanel", "ValidatorPanel"]
