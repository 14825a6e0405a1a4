"""`serve.simulate_cheat`: the reference server as a lying miner runs it, on the embedded model.

It passes the load-time weights check with the checkpoint on disk, then serves weights altered
in memory (`engy_node.calibration.SIMULATED_CHEATS`); what it reports — `/server_info`'s and
the `serve` state's `weights_root` — stays the checkpoint's, and it says it is cheating.
"""

from __future__ import annotations

import logging
import os

import httpx
import pytest
import trio

from engy_node.calibration import SIMULATED_CHEATS, add_weight_noise
from engy_node.config import load_config
from engy_node.errors import ConfigError
from engy_node.hub import Hub
from engy_node.models import SMOLLM2_135M
from engy_node.serve.app import decode_array
from engy_node.serve.engine import ModelRunner
from engy_node.serve.server import serve_reference
from engy_node.simulated_cheats import SIMULATED_CHEAT_NAMES

PROMPT_IDS = [1, 504, 3575, 282, 4649, 314]


def serve_config(tmp_path, checkpoint, **serve):
    cache = {k: v for k, v in os.environ.items() if k == "ENGY_MODEL_CACHE"}
    return load_config(
        home=tmp_path,
        env=cache,
        overrides={"serve": {"checkpoint": str(checkpoint), "port": 0, "device": "cpu", **serve}},
    )


def test_an_unknown_cheat_is_refused_at_load_naming_the_known_ones(tmp_path):
    with pytest.raises(ConfigError) as refused:
        load_config(home=tmp_path, env={}, overrides={"serve": {"simulate_cheat": "noise-2%"}})
    message = str(refused.value)
    assert "serve.simulate_cheat = 'noise-2%'" in message
    assert all(name in message for name in SIMULATED_CHEATS)


async def test_a_cheating_server_serves_perturbed_weights_but_reports_the_checkpoints_root(
    checkpoint, runner, tmp_path, caplog
):
    config = serve_config(tmp_path, checkpoint, simulate_cheat="noise-1%")
    hub = Hub()
    caplog.set_level(logging.WARNING, logger="engy.serve")
    async with trio.open_nursery() as nursery:
        url = await nursery.start(serve_reference, config, hub)
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            info = (await client.get("/server_info")).json()
            body = {"input_ids": PROMPT_IDS, "hidden_dtype": "float32"}
            served = decode_array((await client.post("/engy/prefill", json=body)).json()["hidden_states"])
        nursery.cancel_scope.cancel()

    assert info["weights_root"] == SMOLLM2_135M.weights_root
    assert info["simulated_cheat"] == "noise-1%"
    state = hub.states()["serve"]
    assert state["weights_root"] == SMOLLM2_135M.weights_root and state["simulated_cheat"] == "noise-1%"
    assert any("SIMULATED CHEAT" in r.getMessage() and r.levelname == "WARNING" for r in caplog.records)

    # The same perturbation (the calibration's, seeded) applied to a fresh copy gives the served
    # states; the honest model's are far from them.
    noisy = add_weight_noise(ModelRunner.load(checkpoint, device="cpu", dtype="bfloat16"), 1e-2)
    perturbed, _ = noisy.prefill(PROMPT_IDS)
    honest, _ = runner.prefill(PROMPT_IDS)
    served = served.float()
    to_perturbed = (served - perturbed.float()).abs().max().item()
    to_honest = (served - honest.float()).abs().max().item()
    assert to_perturbed * 10 < to_honest, (to_perturbed, to_honest)
    assert served.shape == honest.shape


def test_the_light_list_of_names_is_the_cheats_there_are():
    """Config checks names without the model stack (`engy_node.simulated_cheats`): the same list."""
    assert tuple(SIMULATED_CHEATS) == SIMULATED_CHEAT_NAMES
