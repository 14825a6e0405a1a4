"""The miner role: GPU detection, planning, model-server supervision and the gateway link."""
