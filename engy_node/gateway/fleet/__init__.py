"""How one gateway becomes many: worker processes on a host, hosts behind a load balancer.

`workers.py` runs `gateway.workers` processes on one host's shared ports; `leadership.py` picks the
one host of a fleet that closes epochs and runs the traffic control plane, by a lease in the
shared store; `load_balancer.py` writes the HAProxy configuration in front of the hosts
(docs/scale-out.md).
"""
