"""The machine's GPUs, for every part that needs them without being a role: detection and NVML
(`gpu.py`), tensor/data-parallel planning over what was found (`plan.py`), and live monitoring
into the hub (`monitor.py`). The miner serves on what they find, `engy-node setup` and the TUI
show it, and none of them imports another's role to get it.
"""
