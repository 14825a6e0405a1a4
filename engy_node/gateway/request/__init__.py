"""One buyer request's way through the gateway, from its body to its log row.

`lifecycle.py` holds the steps (`Gateway`: authenticate, render and tokenise, hold, dispatch with
retries, settle, record); `intake.py` the cheap checks that come before any costly work;
`admission.py` the fair queue a request waits in while no miner has room; `relay.py` the chat
route that streams a miner's answer to the buyer; `corrections.py` what the gateway repairs in an
answer from facts it holds; `request_log.py` the batched writer of each request's metadata row.
What the buyer sent and how it is written back is `gateway/api/`; which miner serves it,
`gateway/routing/`; what it costs, `gateway/billing/`.
"""
