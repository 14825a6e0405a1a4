"""Alerts: the node's own states judged against an operator's thresholds, and the notifications
that follow, delivered to chat webhooks (docs/operations.md).

Split the way the rest of the node is: `state` holds the published snapshot types (imported by
`engy_node.snapshots`, so this file imports nothing), `settings` the config section, `rules` the
pure decisions (which conditions hold, which of them are new, still firing or recovered), `webhooks`
the pure payload shapes of each chat service, and `task` the thin trio shell that reads the hub,
runs the rules, posts the notifications and publishes the `alerts` state.
"""
