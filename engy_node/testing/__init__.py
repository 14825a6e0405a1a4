"""Stand-ins for what lies outside this process, for tests, benchmarks and local experiments.

Each one speaks the real interface: the peers (`gateway`, `synthetic_miner`) the wire protocol
over real sockets, the fake GPU driver (`nvml`) NVML's calls and error classes. None replaces
a part of the node.
"""
