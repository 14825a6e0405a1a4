"""engy node: the headless core of the SN53 stack (miner, validator and gateway roles).

This package never imports textual or rich, and importing it imports nothing heavy: torch,
transformers and bittensor load inside the functions that need them, so `engy-node --help`,
the TUI's bridge and the tests of pure modules start in milliseconds.
"""

__version__ = "0.1.0"
