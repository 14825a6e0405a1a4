"""The buyer API: its HTTP surface and the two wire formats it speaks.

`app.py` is the route table (and the miner endpoint's), `chat.py` the gateway's internal request
and error types, `openai_api.py` and `anthropic_api.py` translate each dialect to and from them,
and `validation.py` holds the field checks both share. Everything here but `app.py` is pure: what a
request is and how an answer is written, with no IO, so the wire formats are tested byte for byte.
"""
