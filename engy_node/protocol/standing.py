"""The gateway's circuit-breaker bars as miners and their tools see them: how long served
requests and verdicts count, and how many `unproven` verdicts pull a worker off paid traffic.

The gateway's traffic control (`gateway.trust.traffic_state.TrafficPolicy`) takes its defaults from here,
and the TUI's miner panel explains a miner's standing with the same numbers, without importing
the gateway. `docs/trust.md` gives the reasons for each figure.
"""

SERVED_WINDOW_S = 60.0
"""Served requests count for the breaker this long after they end."""
VERDICT_WINDOW_S = 300.0
"""Verdicts count for the unproven rate this long after they arrive."""
MAX_UNPROVEN_PCT = 20
"""More than this share (whole percent) of a worker's recent verdicts `unproven` pulls it."""
