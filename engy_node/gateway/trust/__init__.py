"""Who may serve paid traffic, and whether what was served was honest (docs/trust.md).

`traffic.py` is the eligibility state machine per (miner, model), pure, over the data in
`traffic_state.py`, with `traffic_probes.py` saying when to probe and how a probe looks;
`control_plane.py` is their shell, feeding the machine connections, outcomes and verdicts and
sending the probes it asks for. Audits: `audit.py` holds sampled responses' proof material in
memory, `audit_desk.py` is where verifiers lease those jobs and hand in verdicts, and
`audit_link.py` carries jobs from every worker process to the one desk. `provider_api.py` is the signed port validators and verifiers use, and
`trust_plane.py` assembles all of it for each gateway process. What an epoch's verdicts earn the
miners is `gateway/billing/`.
"""
