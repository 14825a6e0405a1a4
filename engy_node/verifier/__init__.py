"""The verifier role (docs/validator.md, "Running a verifier"): lease audit jobs, recompute each
answer on the canonical model, judge it (docs/verification.md), post the verdicts.

`engy-node --role verifier` leases from a gateway's signed audit API (`HttpAuditSource`, signed
with the verifier's hotkey, which the gateway allow-lists); a gateway with
`gateway.local_verifier` runs the same loop inside itself on its audit desk (`DeskAuditSource`).

Shape. `Judge` is the blocking part: one `ModelRunner` per model, loaded on first use, and
`proof.verify_commitment` with the runner's prefill as the recompute. `Verifier.run` is the trio
loop around it: lease a batch when it has room, judge each job in a worker thread
(`concurrency` at a time, the only CPU/GPU work), post each verdict as soon as it is made. A
slow verifier only makes jobs wait: it never touches the serving path, and a job whose lease
runs out goes back to the queue for another verifier. Every wait is bounded; a gateway that is
down or refuses a call is retried with backoff, logged with the reason.

A job the verifier cannot judge (an unknown model, a malformed commitment, a recompute that
fails) gets `unproven` with the reason, never `cheat`: only established misbehaviour is a cheat.
An answer that came with no commitment at all is still judged, on its delivered tokens against
the canonical model (`proof.judge_delivered`); its verdict's reason says so (`recompute:…`).

Modules: `role.py` (the loop, `engy-node --role verifier`, and the verifier a gateway runs inside
itself), `judge.py` (the recompute and verdict), `sources.py` (a gateway's signed audit API, one
host or a fleet). What a verifier leases and posts is `engy_node.protocol.audit`: the verifier
never imports the gateway, and the gateway never imports the verifier.
"""
