"""The validator role: the light loop that puts the provider's verified epoch weights on chain
(SPEC §10), the bittensor 11 chain adapter, and the in-process dev chain that local networks and
tests run the real SDK against."""
