"""The names of the weight cheats a reference server can be told to simulate (`serve.simulate_cheat`,
`engy-node up --cheat`), apart from their implementations in `engy_node.calibration`.

Why apart: settings are checked when the config loads, in every role, and the validator must not
reach the model stack (torch, transformers) even through an import it never runs
(tests/test_packaging.py); the cheats themselves need it. `calibration.SIMULATED_CHEATS` has
exactly these names, in this order (a test holds them together).
"""

from __future__ import annotations

from engy_node.errors import ConfigError

SIMULATED_CHEAT_NAMES = (
    "noise-0.1%",
    "noise-0.3%",
    "noise-1%",
    "noise-3%",
    "quantised-8bit",
    "neighbour-layer",
    "final-norm-x1.05",
    "quantised-4bit",
)


def check_simulated_cheat(name: str, *, where: str) -> str:
    """`name` when it is a simulated cheat; otherwise `ConfigError` naming `where` (the setting or
    flag) and the names there are."""
    if name not in SIMULATED_CHEAT_NAMES:
        raise ConfigError(
            f"{where} {name!r} is not a simulated cheat; use one of {', '.join(SIMULATED_CHEAT_NAMES)} "
            "(or leave it empty to serve the weights as loaded)"
        )
    return name
