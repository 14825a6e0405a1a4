"""The trust pipeline of one gateway, assembled from its config: what the first process runs
beside serving (audit desk, provider API, traffic control, epoch publisher, local verifier) and
what every process needs from it (where audit jobs go, who is eligible).

`role.py` builds a `TrustPlane` per process: in the first, `first_process` with everything; in
the others, `other_process`, which only forwards audit jobs (`audit_link.py`) and follows the
eligibility table (`control_plane.EligibilityView`).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import random
from collections.abc import Callable
from pathlib import Path

import trio

from engy_node.config import Config, comma_list
from engy_node.errors import ConfigError
from engy_node.gateway.billing.epochs import EpochClock
from engy_node.gateway.billing.publisher import EpochPublisher
from engy_node.gateway.billing.settlement import GateMinimums
from engy_node.gateway.fleet.leadership import Leadership
from engy_node.gateway.request.flight import AuditSink
from engy_node.gateway.request.lifecycle import Gateway
from engy_node.gateway.request.relay import OPENAI, ChatEndpoint
from engy_node.gateway.store import Store
from engy_node.gateway.trust import control_plane
from engy_node.gateway.trust.audit import AuditQueue
from engy_node.gateway.trust.audit_desk import AuditDesk, Challenger, DeskAuditSource
from engy_node.gateway.trust.audit_link import AuditLinkClient, AuditLinkServer
from engy_node.gateway.trust.provider_api import ProviderApi, build_provider_app
from engy_node.gateway.trust.traffic_probes import ProbePlan
from engy_node.hub import Hub
from engy_node.probe_corpus import ProbePrompt, load_probe_corpus
from engy_node.protocol.audit import LocalVerifier
from engy_node.served_model import ServedModel

log = logging.getLogger("engy.gateway")

AUDIT_COUNTS_S = 1.0


@dataclasses.dataclass
class TrustPlane:
    audit: AuditSink | None
    """Where this process's sampled responses go."""
    eligible: Callable[[str, str], bool]
    services: list[Callable]
    """Background tasks this process runs (`nursery.start` each)."""
    provider_app: object | None = None
    """The provider API (first process only)."""
    leadership: Leadership | None = None

    @classmethod
    def first_process(
        cls,
        config: Config,
        *,
        store: Store,
        models: dict[str, ServedModel],
        hub: Hub,
        link_token: str | None,
        leadership: Leadership | None = None,
        local_verifier: LocalVerifier | None = None,
        challenge: Challenger | None = None,
    ) -> TrustPlane:
        """`leadership`: this host's claim on the fleet's leader lease (None: alone on its store);
        only the leader closes epochs and runs traffic control. `local_verifier`: the verifier to
        run on the desk with `gateway.local_verifier` (the node supplies the verifier role's).
        `challenge`: how the desk relays GEMM challenges to miners (this process's pool)."""
        settings = config.gateway
        if settings.local_verifier and local_verifier is None:
            raise ConfigError(
                "gateway.local_verifier is on but this gateway was started without a verifier to run; "
                "start it with `engy-node --role gateway`, or set gateway.local_verifier = false"
            )
        desk = AuditDesk(
            queue=AuditQueue(
                lease_s=settings.audit_lease_s, ttl_s=settings.proof_tee_ttl_s, max_jobs=settings.proof_tee_max_entries
            ),
            store=store,
            challenge=challenge,
            opening_timeout_s=settings.gemm_opening_timeout_s,
        )
        publisher = EpochPublisher(
            store=store,
            clock=EpochClock(settings.epoch_genesis, settings.epoch_s, settings.epoch_grace_s),
            netuid=config.node.netuid,
            master=_master_keypair(config),
            owner_hotkey=settings.owner_hotkey,
            models={model_id: model.spec for model_id, model in models.items()},
            minimums=GateMinimums(*(settings.gate_min_samples,) * 3),
            hub=hub,
            leadership=leadership,
        )
        api = ProviderApi(
            desk=desk,
            store=store,
            netuid=config.node.netuid,
            verifiers=frozenset(comma_list(settings.verifiers)),
            current_epoch=publisher.current,
        )
        plane = cls(
            audit=desk,
            eligible=lambda miner, model: True,
            services=[desk.run, publisher.run, functools.partial(_publish_audit_counts, desk, hub)],
            provider_app=build_provider_app(api),
            leadership=leadership,
        )
        if leadership is not None:
            plane.services.insert(0, leadership.run)
        if link_token is not None:
            plane.services.append(AuditLinkServer(link_token, desk).run)
        if settings.local_verifier and local_verifier is not None:
            checkpoints = {model_id: model.checkpoint for model_id, model in models.items()}
            plane.services.append(functools.partial(local_verifier, DeskAuditSource(desk), checkpoints))
        return plane

    def start_traffic_control(self, config: Config, *, gateway: Gateway, store: Store, hub: Hub) -> None:
        """With qualification on, the control plane decides eligibility and sends probes through
        `gateway` (so it needs the gateway, which needs `eligible`: hence this second step)."""
        settings = config.gateway
        if not settings.qualification:
            bans = _cheat_bans(config, store)
            gateway.eligible = bans.eligible
            self.services.append(bans.run)
            return
        endpoint = ChatEndpoint(gateway, OPENAI)
        try:
            corpus = load_probe_corpus(Path(settings.probe_corpus).expanduser() if settings.probe_corpus else None)
        except (OSError, ValueError) as error:
            raise ConfigError(
                f"gateway.probe_corpus: {error}; fix the file or leave the setting empty for the shipped corpus"
            ) from None

        async def send_probe(miner: str, model: str, plan: ProbePlan, prompt: ProbePrompt) -> None:
            body: dict = {
                "model": model,
                "messages": [dict(message) for message in prompt.messages],
                "max_tokens": plan.max_tokens,
                "stream": plan.stream,
            }
            if plan.temperature is not None:
                body["temperature"] = plan.temperature
            if plan.top_p is not None:
                body["top_p"] = plan.top_p
            if plan.stream:
                body["stream_options"] = {"include_usage": True}
            flight = await gateway.begin_probe(OPENAI.parse(body, gateway), target=miner)
            await endpoint.run_probe(flight)

        def new_control() -> control_plane.TrafficControl:
            return control_plane.TrafficControl(
                store=store,
                connected=gateway.pool.connected,
                models={model_id: model.spec for model_id, model in gateway.models.items()},
                send_probe=send_probe,
                hub=hub,
                corpus=corpus,
                max_probe_tokens=settings.probe_max_tokens,
                probe_concurrency=settings.probe_concurrency,
                policy=control_plane.scaled_policy(
                    time_scale=settings.traffic_time_scale, qualify_probes=settings.qualify_probes
                ),
                first_party=frozenset(comma_list(settings.first_party)),
                rng=random.SystemRandom(),
            )

        leadership = self.leadership
        if leadership is None:
            control = new_control()
            gateway.eligible = control.eligible
            self.services.append(control.run)
            return
        # A fleet: the leader decides and writes the eligibility table; every other host follows
        # it, and so does the leader between terms. Each term starts a fresh control plane.
        view = control_plane.EligibilityView(store, first_party=frozenset(comma_list(settings.first_party)))
        term: list[control_plane.TrafficControl] = []

        async def lead() -> None:
            term[:] = [new_control()]
            await term[0].run()

        def eligible(miner: str, model: str) -> bool:
            return term[0].eligible(miner, model) if term and leadership.leading else view.eligible(miner, model)

        gateway.eligible = eligible
        self.services += [view.run, functools.partial(leadership.while_leading, lead)]

    @classmethod
    def other_process(cls, config: Config, *, store: Store, link_token: str) -> TrustPlane:
        settings = config.gateway
        link = AuditLinkClient(link_token)
        plane = cls(audit=link, eligible=lambda miner, model: True, services=[link.run])
        if settings.qualification:
            view = control_plane.EligibilityView(store, first_party=frozenset(comma_list(settings.first_party)))
            plane.eligible = view.eligible
            plane.services.append(view.run)
        else:
            bans = _cheat_bans(config, store)
            plane.eligible = bans.eligible
            plane.services.append(bans.run)
        return plane


def _cheat_bans(config: Config, store: Store) -> control_plane.CheatBans:
    settings = config.gateway
    policy = control_plane.scaled_policy(time_scale=settings.traffic_time_scale, qualify_probes=settings.qualify_probes)
    return control_plane.CheatBans(
        store, cooldown_s=policy.cheat_cooldown_s, first_party=frozenset(comma_list(settings.first_party))
    )


def _master_keypair(config: Config):
    settings = config.gateway
    if not settings.master_wallet:
        return None
    from engy_node.keys import load_hotkey

    name, hotkey = settings.master_wallet.split("/", 1)
    return load_hotkey(settings.wallets_path, name, hotkey)


async def _publish_audit_counts(desk: AuditDesk, hub: Hub, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    """The audit queue's counts in the hub, for the TUI and the control API."""
    task_status.started()
    while True:
        counts = desk.queue.counts(now=desk.clock())
        hub.set_state("audit", **dataclasses.asdict(counts), recorded=desk.recorded)
        await trio.sleep(AUDIT_COUNTS_S)
