"""Stand-ins for peers outside this process, for tests, benchmarks and local experiments.

Each one speaks the real wire protocol over real sockets; none replaces a part of the node.
"""
