"""The gateway role: buyer APIs, billing, the miner pool and routing."""
