"""`engy-node`: argv -> Config -> services. Owns exit codes and what reaches stderr.

Exit codes: 0 clean stop, 2 a problem the user can fix (bad flag, config, missing model; the
message says what to change), 1 an unexpected failure (traceback in the log), 130 forced stop.

Subcommands:
  serve        the sglang-compatible reference server on the embedded model (docs/architecture.md)
  checkpoint   prepare a model's checkpoint and print its path and model_root
  models       the model catalog
  up           a local network: dev chain, gateway, two miners, validator, verifier, a credited buyer key
  gateway …    gateway administration (buyer keys, credit, usage, miners, trust, epochs)
  plan         GPUs, the model-server plan and the exact command
  status       a running node's state from its control API, each role's verdict and a summary (--json); exit 0
               every role does its job, 1 a role's loop stalled, 2 no node answers, 3 a role is not doing its job
  health       is each role of this home's node doing its job? (exit 0 yes, 1 not running or stalled, 3 a role
               is not: no weights within the activity cutoff, no miner leg up, no eligible miner, …)
  diagnose     a support bundle (.tar.gz): versions, masked config, GPUs, recent logs, the node's status
  calibrate    how far honest serving and known cheats sit apart on this machine
  weights …    weight commitments for the sampled GEMM audits (weights commit --checkpoint DIR)
  service …    systemd units and the validator's docker-compose file (service install --role ROLE)
  (no subcommand) --role ROLE …  run node roles (miner, gateway, verifier, validator)

`calibrate`, `gateway …`, `health`, `status`, `weights …` and `service …` have flags and work enough to read on their own: each is a module of
`engy_node/commands/` (its parser and its run); the others are a few lines each, here.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import sys
import time
from collections.abc import Sequence

from engy_node import __version__
from engy_node.commands import calibrate, gateway_admin, health, service, status, weights
from engy_node.errors import EngyError, RoleError

log = logging.getLogger("engy.cli")

ROLES = ("miner", "validator", "gateway", "verifier")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="engy-node",
        description="engy node: miner, validator and gateway roles for SN53, and the reference model server.",
    )
    parser.add_argument("--version", action="version", version=f"engy-node {__version__}")
    parser.add_argument("--home", help="keep config and state in DIR instead of the user dirs (also $ENGY_HOME)")
    parser.add_argument("--log-level", choices=("debug", "info", "warning", "error"), help="stderr/log file level")
    parser.add_argument(
        "--role", action="append", default=[], metavar="ROLE", help=f"run this role (repeatable): {', '.join(ROLES)}"
    )
    _miner_options(
        parser.add_argument_group(
            "miner role (the public miner's flags and env GW, MINER_KEY, MODEL, "
            "MAX_INFLIGHT, ENGY_WORKER_NAME, SERVE_URL are accepted)"
        )
    )
    validator = parser.add_argument_group("validator role (puts the provider's signed epoch weights on chain)")
    validator.add_argument(
        "--network",
        dest="validator_network",
        metavar="NET",
        help="finney, test, local or a ws(s):// URL (default finney)",
    )
    validator.add_argument(
        "--master-hotkey",
        dest="validator_master_hotkey",
        metavar="SS58",
        help="the pinned master hotkey the provider's epoch results must be signed by",
    )
    validator.add_argument(
        "--validator-wallet", dest="validator_wallet", metavar="NAME", help="wallet of the validator's hotkey"
    )
    validator.add_argument(
        "--validator-hotkey",
        dest="validator_hotkey",
        metavar="NAME",
        help="the validator's hotkey (registered, with a validator permit); it signs the weights",
    )
    verifier = parser.add_argument_group("verifier role (judges a gateway's audit jobs)")
    verifier.add_argument(
        "--provider",
        dest="verifier_provider",
        metavar="URL",
        help="the provider API: the gateway's for a verifier (e.g. http://127.0.0.1:8082), "
        "the epoch publisher's for a validator (default https://provider.engy.ai)",
    )
    verifier.add_argument(
        "--verifier-wallet", dest="verifier_wallet", metavar="NAME", help="wallet of the signing hotkey"
    )
    verifier.add_argument(
        "--verifier-hotkey",
        dest="verifier_hotkey",
        metavar="NAME",
        help="hotkey the gateway allow-lists in gateway.verifiers",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    serve = sub.add_parser(
        "serve",
        help="run the sglang-compatible reference server",
        description="Serve a model over sglang's native HTTP API (/generate, /abort_request, /health, ...).",
    )
    serve.add_argument("--model", help="catalog id (default: smollm2-135m, the embedded model)")
    serve.add_argument("--checkpoint", help="checkpoint directory (default: the embedded model, converted once)")
    serve.add_argument("--host", help="bind address (default 127.0.0.1)")
    serve.add_argument("--port", type=int, help="port (default 30000; 0 picks a free one)")
    serve.add_argument("--device", choices=("auto", "cpu", "cuda"))
    serve.add_argument("--dtype", choices=("bfloat16", "float32", "float16"))
    serve.add_argument("--max-running-requests", type=int)
    serve.add_argument(
        "--stream-hidden-states",
        choices=("cumulative", "final"),
        help="cumulative: every SSE event repeats all hidden states (stock sglang); final: last event only",
    )
    serve.add_argument(
        "--disable-return-hidden-states",
        action="store_true",
        help="answer return_hidden_states with a 400, as sglang without the flag",
    )
    serve.add_argument(
        "--disable-radix-cache",
        action="store_true",
        help="prefill every prompt whole, as sglang's flag: no reuse of a cached prefix (cached_tokens 0)",
    )
    serve.add_argument("--served-model-name")
    serve.add_argument(
        "--simulate-cheat",
        metavar="NAME",
        help="demos and tests of the audits only: alter the weights in memory after the weights check "
        "by this cheat (e.g. noise-1%%; engy_node.calibration.SIMULATED_CHEATS), reporting the checkpoint's root",
    )

    checkpoint = sub.add_parser("checkpoint", help="prepare a model checkpoint and print its path and model_root")
    checkpoint.add_argument("--model", default="smollm2-135m")
    checkpoint.add_argument("--checkpoint", default="")

    sub.add_parser("models", help="list the model catalog")
    status_parser = sub.add_parser(
        "status",
        help="the running node's state and each role's verdict (exit 0 every role does its job, 1 a role's "
        "loop stalled, 2 no node answers, 3 a role is not doing its job)",
        description="Reads the control API of the node running in this home (control.json in its data dir).",
    )
    status_parser.add_argument(
        "--json",
        action="store_true",
        help="print the status document with a `summary` of stable fields per role (docs/control-api.md)",
    )
    health.add_parser(sub, ROLES)
    diagnose = sub.add_parser(
        "diagnose",
        help="write a support bundle: versions, masked config, GPUs, recent logs, the node's status",
        description="Collect what support needs into one .tar.gz (mode 0600), secrets masked and no "
        "buyer content: versions, config, GPU facts, log tails, and the running node's "
        "status, metrics and events.",
    )
    diagnose.add_argument(
        "--output",
        metavar="PATH",
        help="bundle file, or a directory for the default name (default: ./engy-diagnose-<host>-<UTC time>.tar.gz)",
    )
    diagnose.add_argument(
        "--log-lines", type=int, metavar="N", help="lines kept from the end of each log file (default 2000)"
    )

    up = sub.add_parser(
        "up",
        help="run a local network: dev chain, gateway, two miners, validator and verifier, with a credited buyer key",
        description="A working SN53 network on loopback with no GPU and no chain access.",
    )
    up.add_argument(
        "--port-base",
        type=int,
        metavar="N",
        help="buyer API on N, miner websocket N+1, provider API N+2, control API N+3 (0: free ports)",
    )
    up.add_argument("--port", type=int, help="buyer API port (default 8080; 0 picks a free one)")
    up.add_argument("--miner-port", type=int, help="miner websocket port (default 8081; 0 picks a free one)")
    up.add_argument(
        "--provider-port", type=int, help="provider API port: epochs, audit (default 8082; 0 picks a free one)"
    )
    up.add_argument("--control-port", type=int, help="control API port (default: a free one)")
    up.add_argument("--traffic", action="store_true", help="run a demo buyer that keeps requests flowing")
    up.add_argument(
        "--cheat",
        action="append",
        default=[],
        metavar="MINER=CHEAT",
        help="demo of the audits: that local miner serves weights altered by CHEAT while claiming the real ones, "
        "e.g. --cheat miner-2=noise-1%% (repeatable; see engy_node.calibration.SIMULATED_CHEATS)",
    )

    gateway_admin.add_parser(sub)

    plan_parser = sub.add_parser(
        "plan",
        help="detect GPUs, plan the model server and print the exact command",
        description="What `--role miner` would launch, without launching it.",
    )
    _miner_options(plan_parser, suppress=True)

    calibrate.add_parser(sub)
    weights.add_parser(sub)
    service.add_parser(sub)
    return parser


def _miner_options(group, *, suppress: bool = False) -> None:
    default = {"default": argparse.SUPPRESS} if suppress else {}
    group.add_argument(
        "--gateway",
        dest="miner_gateway",
        metavar="URL",
        help="gateway websocket base, e.g. wss://api.engy.ai/gw (env GW)",
        **default,
    )
    group.add_argument(
        "--model", dest="miner_model", metavar="ID", help="catalog id of the served model (env MODEL)", **default
    )
    group.add_argument(
        "--checkpoint",
        dest="miner_checkpoint",
        metavar="DIR",
        help="checkpoint directory (default: the embedded model)",
        **default,
    )
    group.add_argument(
        "--serve-url",
        dest="miner_serve_url",
        metavar="URL[,URL]",
        help="use already-running model server(s) instead of launching one (env SERVE_URL)",
        **default,
    )
    group.add_argument(
        "--max-inflight",
        dest="miner_max_inflight",
        type=int,
        metavar="N",
        help="total concurrent requests advertised (env MAX_INFLIGHT)",
        **default,
    )
    group.add_argument(
        "--worker-name",
        dest="miner_worker_name",
        metavar="NAME",
        help="this rig's name at the gateway (env ENGY_WORKER_NAME)",
        **default,
    )
    group.add_argument(
        "--fake-gpus",
        dest="miner_fake_gpus",
        metavar="SPEC",
        help="plan for simulated GPUs, e.g. 4xRTX4090, print the plan and command, launch nothing",
        **default,
    )
    group.add_argument(
        "--context-length",
        dest="miner_context_length",
        type=int,
        metavar="N",
        help="context length to plan for (default: the model's)",
        **default,
    )
    group.add_argument(
        "--wallet",
        dest="miner_wallet",
        metavar="NAME",
        help="sign hello with this wallet's hotkey instead of a miner key",
        **default,
    )
    group.add_argument("--hotkey", dest="miner_hotkey", metavar="NAME", **default)


def _miner_overrides(args: argparse.Namespace) -> dict[str, dict[str, object]]:
    get = lambda name: getattr(args, name, None)  # noqa: E731
    return {
        "miner": {
            "gateway_url": get("miner_gateway"),
            "model": get("miner_model"),
            "checkpoint": get("miner_checkpoint"),
            "serve_urls": get("miner_serve_url"),
            "max_inflight": get("miner_max_inflight"),
            "worker_name": get("miner_worker_name"),
            "fake_gpus": get("miner_fake_gpus"),
            "context_length": get("miner_context_length"),
            "wallet_name": get("miner_wallet"),
            "wallet_hotkey": get("miner_hotkey"),
        }
    }


def _serve_overrides(args: argparse.Namespace) -> dict[str, dict[str, object]]:
    return {
        "serve": {
            "model": args.model,
            "checkpoint": args.checkpoint,
            "host": args.host,
            "port": args.port,
            "device": args.device,
            "dtype": args.dtype,
            "max_running_requests": args.max_running_requests,
            "stream_hidden_states": args.stream_hidden_states,
            "served_model_name": args.served_model_name,
            "enable_return_hidden_states": False if args.disable_return_hidden_states else None,
            "prefix_cache_tokens": 0 if args.disable_radix_cache else None,
            "simulate_cheat": args.simulate_cheat,
        }
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return _dispatch(parser, args)
    except EngyError as err:
        print(f"engy-node: {err.title}: {err}", file=sys.stderr)
        return err.exit_code
    except KeyboardInterrupt:
        return 130


def _dispatch(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    from engy_node.config import load_config

    node_overrides = {"node": {"log_level": args.log_level}}
    if args.command == "models":
        return _print_models()
    if args.command == "checkpoint":
        config = load_config(home=args.home, overrides=node_overrides)
        return _print_checkpoint(config, args.model, args.checkpoint)
    if args.command == "up":
        from engy_node.local.up import parse_cheats, port_plan

        cheats = parse_cheats(args.cheat)
        ports = port_plan(
            args.port_base,
            buyer=args.port,
            miner=args.miner_port,
            provider=args.provider_port,
            control=args.control_port,
        )
        return _run_up(
            load_config(home=args.home, overrides=node_overrides), ports=ports, traffic=args.traffic, cheats=cheats
        )
    if args.command == "status":
        return status.run(load_config(home=args.home, overrides=node_overrides), as_json=args.json)
    if args.command == "health":
        return health.run(load_config(home=args.home, overrides=node_overrides), args)
    if args.command == "diagnose":
        return _run_diagnose(args, node_overrides)
    if args.command == "gateway":
        return gateway_admin.run(load_config(home=args.home, overrides=node_overrides), args)
    if args.command == "plan":
        from engy_node.miner.role import plan_report

        config = load_config(
            home=args.home, overrides={**node_overrides, **_miner_overrides(args)}, public_miner_env=True
        )
        print(plan_report(config))
        return 0
    if args.command == "calibrate":
        config = load_config(home=args.home, overrides=node_overrides)
        return calibrate.run(config, args)
    if args.command == "weights":
        return weights.run(args)
    if args.command == "service":
        return service.run(load_config(home=args.home, overrides=node_overrides), args, home_given=args.home)
    if args.command == "serve":
        if args.role:
            raise RoleError("`serve` runs the model server alone; drop --role, or run roles without `serve`")
        config = load_config(home=args.home, overrides={**node_overrides, **_serve_overrides(args)})
        return _run_serve(config)
    if not args.role:
        parser.print_help(sys.stderr)
        return 2
    unknown = [role for role in args.role if role not in ROLES]
    if unknown:
        raise RoleError(f"unknown role {unknown[0]!r}; choose from {', '.join(ROLES)}")
    role_overrides = {
        "verifier": {
            "gateway_url": args.verifier_provider,
            "wallet_name": args.verifier_wallet,
            "wallet_hotkey": args.verifier_hotkey,
        },
        "validator": {
            "provider_url": args.verifier_provider,
            "network": args.validator_network,
            "master_hotkey": args.validator_master_hotkey,
            "wallet_name": args.validator_wallet,
            "wallet_hotkey": args.validator_hotkey,
        },
    }
    config = load_config(
        home=args.home,
        overrides={**node_overrides, **_miner_overrides(args), **role_overrides},
        public_miner_env="miner" in args.role,
    )
    return _run_roles(config, args.role)


def node_info(config, roles: Sequence[str]) -> dict:
    """Who the control API says it is."""
    return {
        "version": __version__,
        "pid": os.getpid(),
        "roles": list(roles),
        "started_at": time.time(),
        "home": str(config.paths.data_dir),
        "netuid": config.node.netuid,
    }


def _control_service(config, hub, roles: Sequence[str], actions, *, extra_info: dict | None = None):
    from engy_node.control import serve_control

    return functools.partial(
        serve_control,
        hub,
        data_dir=config.paths.data_dir,
        actions=actions,
        node_info={**node_info(config, roles), **(extra_info or {})},
        host=config.control.host,
        port=config.control.port,
    )


def _run_diagnose(args: argparse.Namespace, node_overrides: dict) -> int:
    from engy_node.config import Config, load_config, resolve_paths
    from engy_node.diagnose import DEFAULT_LOG_LINES, collect
    from engy_node.errors import ConfigError

    # A broken config is when a bundle is needed most: collect with the defaults and say why.
    try:
        config, config_error = load_config(home=args.home, overrides=node_overrides), None
    except ConfigError as error:
        config, config_error = Config(paths=resolve_paths(args.home, os.environ)), str(error)
    log_lines = DEFAULT_LOG_LINES if args.log_lines is None else args.log_lines
    bundle = collect(config, output=args.output, log_lines=log_lines, config_error=config_error)
    print(bundle.path)
    print(bundle.summary())
    return 0


def _print_models() -> int:
    from engy_node.models import CATALOG

    for spec in CATALOG.values():
        embedded = " (embedded)" if spec.embedded else ""
        print(f"{spec.id:18} {spec.display_name}{embedded}  in≤{spec.max_input_tokens} out≤{spec.max_output_tokens}")
    return 0


def _print_checkpoint(config, model_id: str, checkpoint: str) -> int:
    from engy_node.models import model_root
    from engy_node.serve.checkpoint import resolve_checkpoint

    path = resolve_checkpoint(
        model_id=model_id,
        checkpoint=checkpoint,
        models_dir=config.paths.models_dir,
        cache_dir=config.paths.model_cache_dir,
    )
    print(json.dumps({"model": model_id, "checkpoint": str(path), "model_root": model_root(path)}))
    return 0


def _start_logging(config):
    """The node's hub, with every `engy.*` log record routed into it, stderr and the log file."""
    from engy_node.hub import Hub, install_logging

    hub = Hub(ring_size=config.node.log_ring_size)
    install_logging(hub, level=config.node.log_level, log_dir=config.paths.log_dir)
    return hub


def _run_up(config, *, ports: dict, traffic: bool, cheats: dict[str, str]) -> int:
    from engy_node import node
    from engy_node.local.up import banner, network_file, run_up

    hub = _start_logging(config)
    log.info("engy-node %s up: local network in %s (pid %d)", __version__, config.paths.data_dir, os.getpid())

    def on_ready(document) -> None:
        print(banner(document, network_file(config)), flush=True)

    return node.run(
        [
            (
                "local network",
                functools.partial(run_up, config, hub, ports=ports, traffic=traffic, cheats=cheats, on_ready=on_ready),
            )
        ]
    )


def _run_roles(config, roles: list[str]) -> int:
    from engy_node import node
    from engy_node.control import node_actions
    from engy_node.miner.role import plan_report
    from engy_node.roles import check_roles, role_services

    if "miner" in roles and config.miner.fake_gpus:
        print(plan_report(config))
        print("(simulated GPUs: nothing was launched)")
        return 0
    check_roles(config, roles)
    hub = _start_logging(config)
    log.info("engy-node %s: roles %s (pid %d)", __version__, ", ".join(roles), os.getpid())
    actions = node_actions()
    services = [
        ("control API", _control_service(config, hub, roles, actions)),
        *role_services(config, hub, roles, actions),
    ]
    return node.run(services)


def _run_serve(config) -> int:
    from engy_node import node
    from engy_node.serve.server import serve_reference

    hub = _start_logging(config)
    log.info(
        "engy-node %s serve: model %s on %s:%d (pid %d)",
        __version__,
        config.serve.model,
        config.serve.host,
        config.serve.port,
        os.getpid(),
    )
    return node.run([("reference server", functools.partial(serve_reference, config, hub))])
