"""One buyer request's way through the gateway, from its body to its log row.

`lifecycle.py` holds the steps up to the miner's first output (`Gateway`: authenticate, render
and tokenise, hold, route and dispatch, retries); `auth.py` who a request is from (its API key,
cached per process and checked again by every hold); `intake.py` the cheap checks that come before
any costly work; `admission.py` the fair queue a request waits in while no miner has room;
`relay.py` the chat route that streams a miner's answer to the buyer; `corrections.py` what the
gateway repairs in an answer from facts it holds; `accountant.py` what a finished answer goes
through (its proof checked, the audit offered, the charge settled, the log row recorded), over the
pure measures in `accounting.py`; `flight.py` the request's data that all of them share;
`request_log.py` the batched writer of log rows. What the buyer sent and how it is written back is
`gateway/api/`; which miner serves it, `gateway/routing/`; what it costs, `gateway/billing/`.
"""
