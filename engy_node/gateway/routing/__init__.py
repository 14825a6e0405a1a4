"""The miners, and which one serves a request.

`pool.py` is the websocket endpoint miners dial and the legs it keeps (capacity, requests in flight,
admission); `router.py` decides which leg serves a buyer request, as a pure function, over the
per-model `route_table.py` the pool keeps current as legs come, go and change. Which miners may
serve at all is the trust plane's decision (`gateway/trust/`); the pool only asks it.
"""
