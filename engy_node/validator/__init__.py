"""The validator role: the light loop that puts the provider's verified epoch weights on chain
(docs/validator.md) and the bittensor 11 chain adapter. The in-process dev chain that local
networks and tests run the real SDK against is `engy_node.local.devchain`."""
