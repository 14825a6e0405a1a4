"""`engy-node --role miner`: find the GPUs, plan, run the model server, serve the gateway.

Start-up is a sequence of decisions, each logged with its reason so an operator reading the log
knows what the miner chose and why:

1. GPUs, through NVML (`gpu.detect`). None found is a normal state: CPU mode, which serves the
   embedded model on the reference server.
2. The model server: an already-running one when `--serve-url`/`SERVE_URL` is given (the public
   miner's operators keep their sglang), otherwise a plan (`plan.plan`) and a supervised child —
   sglang on GPUs, the reference server on CPU — built by `sglang.command`'s builders.
   With `--fake-gpus` the miner prints the plan and the exact command and stops: nothing can run
   on simulated GPUs.
3. The weights check (`engy_node.gemm.loaded`): the `weights_root` of the checkpoint the model
   server is handed (or, for one already running, the checkpoint the miner reads the model's
   tokenizer from) against the catalog's pin, reported in the miner's state. A mismatch refuses
   to start. The first start on a checkpoint hashes it (about 2 s for the embedded model,
   minutes for a 35B one); later starts read the root from the machine's model cache.
4. GEMM audits: on when every model server says it commits its activations in the format
   the verifier reads (`ServeRotation.gemm_support`): the reference server does; sglang does
   when `miner.gemm_capture` armed its capture (`sglang.capture_client`), which asks for one
   GPU, and for an operator's own sglang when `miner.gemm_capture_urls` names its capture
   port. Then the hello announces `FEATURE_GEMM`; otherwise TOPLOC alone judges the miner.
5. The gateway link, advertising the plan's concurrency, and for a miner with a hotkey a look at
   its newest published epoch now and then (`epoch_watch`), so a gate that zeroed it shows here.

A model that does not fit, a GPU model on a CPU-only machine, a missing sglang or checkpoint
are errors that name the fix before anything is started.

Stopping is ordered, not all at once (`engy_node.miner.drain`): when the node cancels the miner,
the link drains first, while the model server is still up to take the aborts, and the model
server stops only once the legs are closed. The supervisor and the link therefore run in cancel
scopes of their own, shielded from the node's cancellation once they are started; this role's
own task runs the drain and then cancels them, link first.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import platform
import socket
import sys
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import trio

from engy_node import __version__, keys
from engy_node.config import Config
from engy_node.control import Actions
from engy_node.errors import EngyError
from engy_node.gemm.activations import FORMATS as GEMM_FORMATS
from engy_node.gemm.loaded import check_checkpoint
from engy_node.hardware.gpu import GpuInventory, detect
from engy_node.hardware.model_shape import read_model_shape
from engy_node.hardware.plan import Plan, plan
from engy_node.hub import Hub
from engy_node.miner.drain import stop_budget
from engy_node.miner.epoch_watch import EpochWatch
from engy_node.miner.link import GatewayLink, Identity, LinkSettings
from engy_node.miner.serving import RequestHandler, RequestOutcome
from engy_node.miner.sglang import LaunchSpec, ModelServerSupervisor, reference_launch, sglang_launch, shell_command
from engy_node.miner.sglang.capture_client import CapturingServeClient
from engy_node.miner.sglang.command import WEIGHTS_ROOT_ENV
from engy_node.miner.sglang.gemm_capture import ARCHITECTURES as CAPTURED_ARCHITECTURES
from engy_node.models import ModelSpec, get_model
from engy_node.protocol.gemm import FEATURE_GEMM
from engy_node.protocol.miner import FEATURE_SEEDED, OUR_FEATURES, Capacity, KvLoad
from engy_node.serve.checkpoint import resolve_checkpoint
from engy_node.serve.client import GemmSupport, ServeClient, ServeError
from engy_node.served_model import ServedModel, load_served_model
from engy_node.snapshots import GEMM_AND_TOPLOC, TOPLOC_ALONE

log = logging.getLogger("engy.miner")

EXTERNAL_SERVE_DEFAULT_INFLIGHT = 8
"""Concurrency advertised for an already-running server when MAX_INFLIGHT is not set: the
published sglang config's --max-running-requests."""


class MinerError(EngyError):
    title = "miner"


@dataclasses.dataclass(frozen=True, slots=True)
class MinerSetup:
    """Everything decided before anything starts (printable, testable)."""

    spec: ModelSpec
    checkpoint: Path
    inventory: GpuInventory
    plan: Plan | None
    launch: LaunchSpec | None
    serve_urls: tuple[str, ...]
    max_inflight: int
    capture_urls: tuple[str, ...] = ()
    """The GEMM capture's port beside each model server ("" where none), in the order of
    `serve_urls` (or for the one launched)."""

    def describe(self) -> list[str]:
        lines = [f"model: {self.spec.id} ({self.spec.display_name}) from {self.checkpoint}"]
        if self.inventory.cpu_mode:
            lines.append(f"GPUs: none — {self.inventory.reason}")
        else:
            lines += [f"GPUs: driver {self.inventory.driver_version}, CUDA {self.inventory.cuda_driver_version}"]
            lines += [f"  {info.describe()}" for info in self.inventory.gpus]
        if self.plan is not None:
            lines.append(f"plan: {self.plan.summary}")
            lines += [f"  {name}: {reason}" for name, reason in self.plan.reasons.items()]
        if self.launch is not None:
            lines.append(f"command: {shell_command(self.launch)}")
        if self.serve_urls:
            lines.append(f"model server(s): {', '.join(self.serve_urls)} (already running)")
        if any(self.capture_urls):
            lines.append(f"GEMM capture: {', '.join(url or 'none' for url in self.capture_urls)}")
        lines.append(f"max in flight: {self.max_inflight}")
        return lines


def detect_gpus(fake_spec: str) -> GpuInventory:
    if fake_spec:
        from engy_node.hardware.fake_nvml import FakeNvml  # only --fake-gpus loads the fakes

        try:
            nvml = FakeNvml.from_spec(fake_spec)
        except EngyError as error:
            raise MinerError(f"--fake-gpus {fake_spec!r}: {error}") from None
        return detect(nvml=nvml)
    return detect()


def free_loopback_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def decide(config: Config, inventory: GpuInventory) -> MinerSetup:
    """Pick checkpoint, plan and launch command (blocking: reads the checkpoint's config)."""
    settings = config.miner
    spec = get_model(settings.model)
    if not settings.checkpoint and not spec.embedded:
        raise MinerError(f"model {spec.id} needs its checkpoint: pass --checkpoint DIR (the directory sglang loads)")
    checkpoint = resolve_checkpoint(
        model_id=spec.id,
        checkpoint=settings.checkpoint,
        models_dir=config.paths.models_dir,
        cache_dir=config.paths.model_cache_dir,
    )
    serve_urls = tuple(url.strip().rstrip("/") for url in settings.serve_urls.split(",") if url.strip())
    if settings.simulate_cheat and serve_urls:
        raise MinerError(
            f"miner.simulate_cheat = {settings.simulate_cheat!r} needs a reference server this miner launches, "
            "but --serve-url names one already running: start that server with --simulate-cheat instead, "
            "or drop one of the two"
        )
    capture_urls = tuple(url.strip().rstrip("/") for url in settings.gemm_capture_urls.split(","))
    if serve_urls:
        if settings.gemm_capture:
            raise MinerError(
                "miner.gemm_capture arms the capture in an sglang server this miner launches, and "
                "miner.serve_urls names servers you run: launch those with the capture armed and name its ports "
                'in miner.gemm_capture_urls instead (docs/protocol.md, "The capture in sglang")'
            )
        if settings.gemm_capture_urls and len(capture_urls) != len(serve_urls):
            raise MinerError(
                f"miner.gemm_capture_urls names {len(capture_urls)} capture port(s) for {len(serve_urls)} "
                "model server(s) in miner.serve_urls: give one per server, in the same order (leave one empty "
                "for a server without the capture)"
            )
        return MinerSetup(
            spec,
            checkpoint,
            inventory,
            None,
            None,
            serve_urls,
            settings.max_inflight or EXTERNAL_SERVE_DEFAULT_INFLIGHT,
            capture_urls if settings.gemm_capture_urls else (),
        )
    if settings.gemm_capture_urls:
        raise MinerError(
            "miner.gemm_capture_urls names the capture ports of servers you run (miner.serve_urls), and none is "
            "given: set miner.gemm_capture = true to arm the capture in the sglang server this miner launches"
        )

    shape, weight_bytes = read_model_shape(checkpoint)
    chosen = plan(
        shape=shape,
        weight_bytes=weight_bytes,
        gpus=inventory.gpus,
        p2p=inventory.p2p_ok_matrix,
        target_context=settings.context_length or None,
        cpu_capable=spec.embedded,
    )
    if not chosen.fits:
        raise MinerError(f"{spec.id} cannot be served here: {chosen.summary}")
    if settings.simulate_cheat and chosen.server != "reference":
        raise MinerError(
            f"miner.simulate_cheat = {settings.simulate_cheat!r}: only the reference server simulates a cheat, "
            f"and this plan launches {chosen.server}; unset miner.simulate_cheat (it is for demos and tests)"
        )
    port = settings.serve_port or free_loopback_port()
    capture_port = None
    if settings.gemm_capture and chosen.server == "sglang":
        if shape.architecture not in CAPTURED_ARCHITECTURES:
            raise MinerError(
                f"miner.gemm_capture hooks sglang's {', '.join(CAPTURED_ARCHITECTURES)} (dense, Llama-shaped), and "
                f"{spec.id} is a {shape.architecture}: unset miner.gemm_capture (TOPLOC alone judges a miner of "
                "this model)"
            )
        if chosen.tp != 1 or chosen.dp != 1:
            why = (
                "the capture cannot read projections sharded over GPUs"
                if chosen.tp != 1
                else "each replica would need a capture port of its own"
            )
            raise MinerError(
                f"miner.gemm_capture arms one sglang replica on one GPU, and the plan for {spec.id} is "
                f"{chosen.summary} ({why}). Unset miner.gemm_capture (TOPLOC alone then judges this miner), or run "
                "one sglang per GPU yourself with the capture armed and name them in miner.serve_urls and "
                "miner.gemm_capture_urls"
            )
        capture_port = free_loopback_port()
    elif settings.gemm_capture:
        log.info("miner.gemm_capture: the reference server commits its activations itself; nothing to arm")
    if chosen.server == "reference":
        # The child gets a home of its own inside ours: its own log file, no shared state.
        launch = reference_launch(
            python=sys.executable,
            home=config.paths.data_dir / "model-server",
            model=spec.id,
            port=port,
            checkpoint=checkpoint,
            max_running_requests=chosen.max_running_requests,
            simulate_cheat=settings.simulate_cheat or None,
        )
    else:
        launch = sglang_launch(
            python=sys.executable,
            checkpoint=checkpoint,
            served_model_name=spec.id,
            port=port,
            tp=chosen.tp,
            dp=chosen.dp,
            mem_fraction_static=chosen.mem_fraction_static,
            max_running_requests=chosen.max_running_requests,
            context_length=chosen.context_length,
            kv_cache_dtype=chosen.kv_cache_dtype,
            chunked_prefill_size=chosen.chunked_prefill_size,
            gemm_capture_port=capture_port,
            extra_flags=chosen.extra_flags,
        )
        launch = dataclasses.replace(
            launch,
            env=launch.env
            + (
                # NVML numbers GPUs in PCI order; CUDA's default order is "fastest first".
                ("CUDA_DEVICE_ORDER", "PCI_BUS_ID"),
                ("CUDA_VISIBLE_DEVICES", ",".join(map(str, chosen.gpu_indices))),
            ),
        )
    return MinerSetup(
        spec,
        checkpoint,
        inventory,
        chosen,
        launch,
        (),
        settings.max_inflight or chosen.max_inflight,
        (f"http://127.0.0.1:{capture_port}",) if capture_port is not None else (),
    )


def with_capture_weights_root(setup: MinerSetup, weights_root: str) -> MinerSetup:
    """`setup` with the checked checkpoint's root handed to the GEMM capture it arms in sglang,
    which writes it into every commitment as the reference server does its own; unchanged
    when it arms none."""
    if setup.launch is None or not setup.capture_urls:
        return setup
    env = setup.launch.env + ((WEIGHTS_ROOT_ENV, weights_root),)
    return dataclasses.replace(setup, launch=dataclasses.replace(setup.launch, env=env))


def hardware(inventory: GpuInventory, setup_plan: Plan | None) -> dict[str, Any]:
    import psutil

    gpus = inventory.gpus
    return {
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "ram_gb": round(psutil.virtual_memory().total / 2**30, 1),
        "gpu": gpus[0].name if gpus else "cpu",
        "gpu_count": len(gpus),
        "gpu_mem_gb": round(gpus[0].memory_total_bytes / 2**30, 1) if gpus and gpus[0].memory_total_bytes else 0,
        "torch": _version("torch"),
        "cuda": inventory.cuda_driver_version,
        "gpus": [
            {"name": g.name, "uuid": g.uuid, "mem_gb": round((g.memory_total_bytes or 0) / 2**30, 1)} for g in gpus
        ],
        "parallelism": {"tp": setup_plan.tp, "dp": setup_plan.dp} if setup_plan else {},
    }


def _version(package: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return None


def preflight(config: Config) -> Identity:
    """The checks that need no IO beyond reading a wallet: run before anything starts."""
    if not config.miner.gateway_url:
        raise MinerError("no gateway: set GW (or ENGY_MINER__GATEWAY_URL, or --gateway), e.g. wss://api.engy.ai/gw")
    return identity(config)


def identity(config: Config) -> Identity:
    settings = config.miner
    if settings.wallet_name and settings.wallet_hotkey:
        keypair = keys.load_hotkey(
            Path(settings.wallets_path).expanduser(), settings.wallet_name, settings.wallet_hotkey
        )
        return Identity(miner_key=settings.miner_key, keypair=keypair, netuid=config.node.netuid)
    if not settings.miner_key:
        raise MinerError(
            "no miner identity: set MINER_KEY (or ENGY_MINER__MINER_KEY), or a registered hotkey "
            "with --wallet NAME --hotkey HOTKEY"
        )
    return Identity(miner_key=settings.miner_key, netuid=config.node.netuid)


def register_restart(actions: Actions, supervisor: ModelServerSupervisor, hub_component: str) -> None:
    """The operator's "restart model server" (the TUI's `r`, `POST /v1/actions/...`)."""
    suffix = "" if hub_component == "miner" else f"-{hub_component}"

    async def restart(params: dict) -> dict:
        try:
            await supervisor.restart()
        except RuntimeError as error:
            raise MinerError(str(error)) from None
        return {"restarted": True, "command": supervisor.command}

    actions.register(
        f"restart-model-server{suffix}", f"restart the model server of {hub_component}", restart, timeout_s=120.0
    )


class MinerMetrics:
    """Per-request metrics in the hub's registry (what the TUI's requests panel reads)."""

    def __init__(self, hub: Hub) -> None:
        registry = hub.registry
        from engy_node.metrics import ITL_BUCKETS, TTFT_BUCKETS

        self.hub = hub
        self.ttft = registry.histogram(
            "engy_miner_ttft_seconds", "Time to first token seen by the miner.", buckets=TTFT_BUCKETS
        )
        self.tpot = registry.histogram(
            "engy_miner_tpot_seconds", "Time per output token after the first.", buckets=ITL_BUCKETS
        )
        self.proof = registry.histogram(
            "engy_miner_proof_seconds",
            "TOPLOC commitment build time per request.",
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5),
        )
        self.requests = registry.counter(
            "engy_miner_requests_total", "Requests served, by outcome.", labelnames=("outcome",)
        )
        self.tokens = registry.counter("engy_miner_tokens_total", "Tokens processed, by kind.", labelnames=("kind",))

    def record(self, outcome: RequestOutcome) -> None:
        self.requests.labels(outcome="ok" if outcome.ok else (outcome.error_class or "error")).inc()
        if outcome.ok:
            self.tokens.labels(kind="prompt").inc(outcome.prompt_tokens)
            self.tokens.labels(kind="completion").inc(outcome.completion_tokens)
            self.proof.observe(outcome.proof_s)
            if outcome.ttft_s is not None:
                self.ttft.observe(outcome.ttft_s)
            if outcome.tpot_s is not None:
                self.tpot.observe(outcome.tpot_s)


class ServeRotation:
    """Spreads requests over several already-running servers in turn."""

    def __init__(
        self,
        urls: tuple[str, ...],
        http: httpx.AsyncClient,
        *,
        request_timeout_s: float,
        capture_urls: tuple[str, ...] = (),
    ) -> None:
        """`capture_urls`: the GEMM capture's port beside each server ("" where none), or empty."""
        captures = capture_urls or ("",) * len(urls)
        self.clients = [
            CapturingServeClient(url, http, capture_url=capture, request_timeout_s=request_timeout_s)
            if capture
            else ServeClient(url, http, request_timeout_s=request_timeout_s)
            for url, capture in zip(urls, captures, strict=True)
        ]
        self._next = 0
        self.proofs: str | None = None
        """Which proofs judge this miner (`GEMM_AND_TOPLOC` or `TOPLOC_ALONE`), once
        `gemm_support` has asked; `proofs_detail` says with what or why."""
        self.proofs_detail = ""

    def __call__(self) -> ServeClient:
        client = self.clients[self._next % len(self.clients)]
        self._next += 1
        return client

    async def kv_load(self) -> KvLoad | None:
        """The servers' KV cache and queue summed, as the TEE miner reports them (`kv`); None
        when no server says (an sglang without `/get_load`)."""
        ranks: list = []
        limit = 0
        for client in self.clients:
            if client.http.is_closed:
                return None  # shutting down
            try:
                loads, size = await client.load()
            except (httpx.HTTPError, ServeError, ValueError) as error:
                log.debug("no load from %s (%s: %s)", client.base_url, type(error).__name__, error)
                continue
            ranks += loads if isinstance(loads, list) else []
            limit += size or 0
        return KvLoad.of_ranks(ranks, limit or None)

    async def gemm_support(self) -> GemmSupport | None:
        """What activation commitments every server makes (the smallest record store of them),
        or None when one cannot — or does not say: a miner takes GEMM audits only when every
        answer it serves can be challenged. The decision is logged with its reason and kept in
        `proofs` and `proofs_detail` for the miner's state."""
        supports = []
        for client in self.clients:
            try:
                support = await client.gemm_support()
            except ServeError as error:
                self._gemm_off(str(error), logging.WARNING)
                return None
            if support is None or support.format not in GEMM_FORMATS:
                named = "it names none" if support is None else f"it names {support.format}"
                self._gemm_off(
                    f"the model server {client.base_url} does not commit its activations in "
                    f"{' or '.join(GEMM_FORMATS)} ({named})",
                    logging.INFO,
                )
                return None
            supports.append(support)
        chosen = min(supports, key=lambda support: support.most_positions)
        formats = " and ".join(sorted({support.format for support in supports}))
        self.proofs = GEMM_AND_TOPLOC
        self.proofs_detail = f"{formats}, up to {chosen.most_positions} positions an answer"
        log.info(
            "GEMM audits on: the model server(s) commit %s activations, up to %d positions per answer",
            formats,
            chosen.most_positions,
        )
        return chosen

    def _gemm_off(self, reason: str, level: int) -> None:
        self.proofs, self.proofs_detail = TOPLOC_ALONE, reason
        log.log(level, "GEMM audits off: %s; TOPLOC alone judges this miner", reason)


def server_record_path(config: Config, server_hub_component: str) -> Path:
    """Where the miner records the model server it runs, for the next start in this home
    (`sglang.leftovers`); one file per supervised server."""
    return config.paths.data_dir / "run" / f"{server_hub_component}.json"


async def _run_in(scope: trio.CancelScope, service, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Run `service` inside `scope`, so the caller decides when it stops."""
    with scope:
        await service(task_status=task_status)


async def run_miner(
    config: Config,
    hub: Hub,
    *,
    ready_when_admitted: bool = False,
    hub_component: str = "miner",
    server_hub_component: str = "model_server",
    actions: Actions | None = None,
    task_status=trio.TASK_STATUS_IGNORED,
) -> None:
    """The miner service: ready once the model server answers, and the link keeps dialling; with
    `ready_when_admitted`, ready once the gateway has admitted a leg too (a local network says
    it is up only when a buyer's first request can be served). Several miners in one process
    (a local network) report under their own hub components.

    Cancellation drains (see the module docstring): it returns once the legs are closed and
    the model server is gone, within `stop_budget(drain_s=...).total_s` of the cancel."""
    settings = config.miner
    budget = stop_budget(drain_s=settings.drain_s)
    miner_identity = preflight(config)
    inventory = await trio.to_thread.run_sync(detect_gpus, settings.fake_gpus)
    if inventory.cpu_mode:
        log.info("no NVIDIA GPU: %s — CPU mode serves the embedded model on the reference server", inventory.reason)
    setup = await trio.to_thread.run_sync(decide, config, inventory)
    for line in setup.describe():
        log.info("%s", line)
    hub.set_state(
        hub_component,
        model=setup.spec.id,
        max_inflight=setup.max_inflight,
        cpu_mode=inventory.cpu_mode,
        plan=setup.plan.summary if setup.plan else None,
        command=shell_command(setup.launch) if setup.launch else None,
        # A miner known by its miner key alone has no hotkey to show.
        hotkey=miner_identity.keypair.ss58_address if miner_identity.keypair is not None else None,
        simulated_cheat=settings.simulate_cheat or None,
    )
    if settings.simulate_cheat:
        log.warning(
            "SIMULATED CHEAT: this miner's model server serves weights altered by %s (miner.simulate_cheat); "
            "its answers should be judged cheats by GEMM audits. For demos and tests only",
            settings.simulate_cheat,
        )
    if setup.launch is not None and setup.launch.kind == "sglang" and not _sglang_installed():
        raise MinerError(
            "sglang is not installed in this environment: pip install 'engy-node[gpu]', "
            "or run sglang yourself and pass --serve-url"
        )
    # Before the server starts, so a wrong checkpoint is refused before GPUs load it, and a
    # reference server launched below finds the root in the machine's cache.
    weights = await trio.to_thread.run_sync(
        check_checkpoint, setup.spec, setup.checkpoint, config.paths.model_cache_dir
    )
    hub.set_state(hub_component, weights_root=weights.root, weights_pinned=weights.pinned)
    setup = with_capture_weights_root(setup, weights.root)

    served: ServedModel = await trio.to_thread.run_sync(load_served_model, setup.spec, setup.checkpoint)
    metrics = MinerMetrics(hub)
    async with httpx.AsyncClient(timeout=httpx.Timeout(30.0, read=None)) as http, trio.open_nursery() as nursery:
        # Each is shielded as soon as it has started: until then a cancel stops it as usual.
        server_scope, link_scope = trio.CancelScope(), trio.CancelScope()
        link: GatewayLink | None = None
        serve_ready: Callable[[], bool] = lambda: True  # noqa: E731 (a remote serve is always ready)
        try:
            if setup.launch is not None:
                supervisor = ModelServerSupervisor(
                    setup.launch,
                    hub,
                    hub_component=server_hub_component,
                    record_path=server_record_path(config, server_hub_component),
                )
                serve_urls: tuple[str, ...] = (await nursery.start(_run_in, server_scope, supervisor.run),)
                server_scope.shield = True
                serve_ready = lambda: supervisor.ready  # noqa: E731
                if actions is not None:
                    register_restart(actions, supervisor, hub_component)
            else:
                serve_urls = setup.serve_urls
            serves = ServeRotation(
                serve_urls, http, request_timeout_s=setup.spec.max_request_s, capture_urls=setup.capture_urls
            )
            gemm = await serves.gemm_support()
            hub.set_state(hub_component, proofs=serves.proofs, proofs_detail=serves.proofs_detail)
            link = _link(
                config, setup, served, miner_identity, hub, hub_component, http, metrics, serves, serve_ready, gemm
            )
            if ready_when_admitted:
                await nursery.start(_run_in, link_scope, link.run)
            else:
                nursery.start_soon(_run_in, link_scope, link.run)
            link_scope.shield = True
            if miner_identity.keypair is not None:
                watch = EpochWatch(
                    http=http,
                    gateway_url=settings.gateway_url,
                    hotkey=miner_identity.keypair.ss58_address,
                    hub=hub,
                    hub_component=hub_component,
                )
                nursery.start_soon(watch.run)
            task_status.started(f"serving {setup.spec.id} via {', '.join(serve_urls)} to {settings.gateway_url}")
            await trio.sleep_forever()
        finally:
            # Shielded, and bounded by the drain's own steps (plus a second for the bookkeeping).
            with trio.CancelScope(shield=True), trio.move_on_after(budget.link_s + 1.0):
                if link is not None:
                    await link.drain(budget)
            link_scope.cancel(reason="the miner has drained")
            server_scope.cancel(reason="the miner's legs are closed")


def _link(
    config: Config,
    setup: MinerSetup,
    served: ServedModel,
    miner_identity: Identity,
    hub: Hub,
    hub_component: str,
    http: httpx.AsyncClient,
    metrics: MinerMetrics,
    serves: ServeRotation,
    serve_ready: Callable[[], bool],
    gemm: GemmSupport | None,
) -> GatewayLink:
    """The gateway link for `setup`, serving through `serves` while `serve_ready()`, taking GEMM
    audits when `gemm` says the serves can."""
    settings = config.miner
    handler = RequestHandler(
        model=served, serve=serves, chunk_tokens=settings.chunk_tokens, on_outcome=metrics.record, gemm=gemm
    )
    spec = setup.spec
    # A server this miner launched samples deterministically (sglang with the flag, or the
    # reference server); one the operator runs (--serve-url) may not, so it is not claimed.
    features = OUR_FEATURES | {FEATURE_SEEDED} if setup.launch is not None else OUR_FEATURES
    return GatewayLink(
        gateway_url=settings.gateway_url,
        identity=miner_identity,
        http=http,
        handler=handler,
        settings=LinkSettings(),
        limits=Capacity(
            max_inflight=0,
            max_inflight_total=setup.max_inflight,
            max_input_tokens=spec.max_input_tokens,
            max_output_tokens=spec.max_output_tokens,
            max_request_s=spec.max_request_s,
        ),
        hello={
            "model": spec.id,
            "model_root": served.model_root,
            "hw": hardware(setup.inventory, setup.plan),
            "versions": {
                "engy_node": __version__,
                "protocol": 1,
                "toploc": _version("toploc"),
                "transformers": _version("transformers"),
                "sglang": _version("sglang"),
            },
            "worker_name": settings.worker_name or platform.node(),
            "worker_id": uuid.uuid4().hex,
        },
        on_state=lambda **values: hub.set_state(hub_component, **values),
        features=features | {FEATURE_GEMM} if gemm is not None else features,
        serve_ready=serve_ready,
        serve_load=serves.kv_load,
        open_gemm=handler.open_gemm if gemm is not None else None,
    )


def _sglang_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("sglang") is not None


def plan_report(config: Config) -> str:
    """GPUs, plan and the exact command, without starting anything (`engy-node plan`, and the
    miner with `--fake-gpus`). Blocking."""
    inventory = detect_gpus(config.miner.fake_gpus)
    setup = decide(config, inventory)
    return "\n".join(setup.describe())
