"""Run the reference server: load the checkpoint, start the engine, serve HTTP on hypercorn.

`serve_reference` is a trio service: it reports ready through `task_status.started(url)` only
after the port is bound, the model is loaded and one warm-up generation has run — the moment
sglang prints "The server is fired up and ready to roll!", which we print too, so a supervisor
can wait on either the log line or `/health`.

Before the model loads, the checkpoint's `weights_root` is found (cached, else computed) and held
against the catalog's pin (`engy_node.gemm.loaded`): a mismatch refuses to serve with the fix
named, a match or a model without a pin is reported in the `serve` state and `/server_info`.

With `serve.simulate_cheat` (demos and tests of the audits only) the loaded weights are then
altered in memory by one of `engy_node.calibration.SIMULATED_CHEATS`, after the check: the
server reports the checkpoint's root while serving other weights, exactly what a lying miner
does, so only a GEMM audit can tell. It says so loudly: a warning at load, `simulated_cheat` in
the `serve` state and `/server_info`.

Loading the model (seconds) runs in a worker thread so the node's other tasks keep running.
On cancellation the HTTP server stops accepting, in-flight requests are aborted and the engine
thread is joined.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import trio

from engy_node.asgi import start_listener
from engy_node.calibration import simulated_cheat
from engy_node.config import Config
from engy_node.gemm.loaded import LoadedWeights, check_checkpoint
from engy_node.hub import Hub
from engy_node.models import get_model, model_root
from engy_node.serve.app import ReferenceApp, ServerInfo, build_app
from engy_node.serve.checkpoint import resolve_checkpoint
from engy_node.serve.engine import Engine, EngineMetrics, Generation, ModelRunner, run_on_engine, run_to_completion
from engy_node.serve.sampling import parse_sampling_params

log = logging.getLogger("engy.serve")

READY_LINE = "The server is fired up and ready to roll!"
WARMUP_PROMPT = "The capital city of France is"


async def load_runner(config: Config) -> tuple[ModelRunner, LoadedWeights]:
    """The model, loaded once its checkpoint's weights passed the check (module doc)."""
    serve = config.serve
    spec = get_model(serve.model)
    checkpoint = await trio.to_thread.run_sync(
        lambda: resolve_checkpoint(
            model_id=serve.model,
            checkpoint=serve.checkpoint,
            models_dir=config.paths.models_dir,
            cache_dir=config.paths.model_cache_dir,
        )
    )
    weights = await trio.to_thread.run_sync(check_checkpoint, spec, checkpoint, config.paths.model_cache_dir)
    log.info("loading %s from %s (%s, %s)", serve.model, checkpoint, serve.dtype, serve.device)
    runner = await trio.to_thread.run_sync(lambda: ModelRunner.load(checkpoint, device=serve.device, dtype=serve.dtype))
    if serve.simulate_cheat:
        cheat = simulated_cheat(serve.simulate_cheat, where="serve.simulate_cheat =")
        log.warning(
            "SIMULATED CHEAT: serving %s's weights altered by %s in memory, while reporting the checkpoint's "
            "weights_root %s; GEMM audits should catch every answer. For demos and tests only: unset "
            "serve.simulate_cheat (--simulate-cheat) to serve honestly",
            serve.model,
            serve.simulate_cheat,
            weights.root,
        )
        await trio.to_thread.run_sync(cheat, runner)
    return runner, weights


def server_info(config: Config, runner: ModelRunner, weights: LoadedWeights, port: int) -> ServerInfo:
    serve = config.serve
    model_config = json.loads((Path(runner.checkpoint) / "config.json").read_text())
    return ServerInfo(
        model_id=serve.model,
        served_model_name=serve.served_model_name or serve.model,
        model_path=str(runner.checkpoint),
        model_root=model_root(runner.checkpoint),
        weights_root=weights.root,
        dtype=serve.dtype,
        device=runner.device,
        host=serve.host,
        port=port,
        max_running_requests=serve.max_running_requests,
        enable_return_hidden_states=serve.enable_return_hidden_states,
        stream_hidden_states=serve.stream_hidden_states,
        architectures=tuple(model_config.get("architectures", [])),
        model_type=str(model_config.get("model_type", "")),
        simulated_cheat=serve.simulate_cheat or None,
    )


async def serve_reference(config: Config, hub: Hub, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Serve until cancelled. `task_status.started` gets the base URL once ready."""
    from hypercorn.config import Config as HypercornConfig

    serve = config.serve
    hub.set_state("serve", state="loading", model=serve.model)
    runner, weights = await load_runner(config)
    metrics = EngineMetrics(hub.registry, model_name=serve.served_model_name or serve.model)
    engine = Engine(
        runner,
        max_running=serve.max_running_requests,
        request_timeout_s=serve.request_timeout_s,
        metrics=metrics,
        prefix_cache_tokens=serve.prefix_cache_tokens,
    )
    engine.start()
    try:
        async with trio.open_nursery() as nursery:
            hc = HypercornConfig()
            hc.bind = [f"{serve.host}:{serve.port}"]
            hc.accesslog = None
            hc.errorlog = logging.getLogger("engy.serve.http")
            hc.graceful_timeout = 2.0
            hc.keep_alive_timeout = 75.0
            placeholder = server_info(config, runner, weights, serve.port)
            reference = ReferenceApp(engine, placeholder, hub.registry)
            binds = await start_listener(nursery, build_app(reference), hc, what="model server", flag="--port")
            url = binds[0]
            port = int(url.rsplit(":", 1)[1])
            reference.info = server_info(config, runner, weights, port)

            await run_on_engine(engine, _warm_up)
            reference.ready = True
            hub.set_state(
                "serve",
                state="ready",
                url=url,
                model=serve.model,
                model_root=reference.info.model_root,
                weights_root=weights.root,
                weights_pinned=weights.pinned,
                device=runner.device,
                dtype=serve.dtype,
                simulated_cheat=serve.simulate_cheat or None,
            )
            log.info("%s (%s on %s)", READY_LINE, serve.model, url)
            task_status.started(url)
    finally:
        hub.set_state("serve", state="stopped")
        engine.abort(abort_all=True, message="server shutting down")
        with trio.CancelScope(shield=True):
            await trio.to_thread.run_sync(engine.stop)


def _warm_up(runner: ModelRunner) -> None:
    """One short greedy generation, as sglang's warm-up does, so the first request is not slow."""
    ids = list(runner.tokenizer(WARMUP_PROMPT)["input_ids"])
    run_to_completion(
        runner,
        Generation(rid="warmup", input_ids=ids, params=parse_sampling_params({"temperature": 0, "max_new_tokens": 8})),
    )
