"""The Logs tab: every component's log lines in one place, the view support staff start from.

The node's hub keeps a ring of log events (`engy_node/hub.py`); the app reads them in batches at
its render rate (2–5 Hz) and hands each batch to `LogsView.append`, never one call per event.
The view keeps its own bounded buffer, so a session can scroll back further than the node's
ring and a flood of events costs bounded memory.

Shape, and why: what a line says (`rows`), whether the operator wants to see it (`filters`),
and which lines are kept, shown and matched (`buffer`) are plain data and plain functions that
need no terminal; `view` is the widget that draws the buffer's shown rows and handles the keys,
`screens` the two screens it opens (a line's context, the component picker).
"""

from engy_tui.widgets.logs.view import LogsView

__all__ = ["LogsView"]
