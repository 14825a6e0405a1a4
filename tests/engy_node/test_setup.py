"""First-run setup's decisions without a terminal: the machine line, wallets read from bittensor's
layout without touching a coldkey, each catalog model's verdict on fake rigs, what answers are
refused and why, node.toml written over an existing one (round-tripped through tomllib and the
real config loader, by hypothesis too), the exact commands, and the private, atomic write."""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
import os
import stat
import tempfile
import tomllib
from pathlib import Path

import pynvml
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from engy_node import keys
from engy_node.config import load_config
from engy_node.errors import ConfigError
from engy_node.hardware.fake_nvml import FAKE_GPU_MODELS, FakeNvml
from engy_node.hardware.gpu import detect
from engy_node.models import CATALOG, GLM_52, QWEN36_35B_A3B, SMOLLM2_135M
from engy_node.setup import (
    CHECKPOINT_NEEDED,
    DEFAULT_GATEWAY_URL,
    NODE_TOML_HEADER,
    ROLES,
    HotkeyEntry,
    SetupAnswers,
    WalletEntry,
    answers_from,
    commands,
    decided_settings,
    dumps_toml,
    gather_facts,
    list_wallets,
    machine_line,
    model_choices,
    node_toml,
    preview_toml,
    read_existing,
    short_ss58,
    validate,
    write_node_toml,
)

FIXTURES = Path(__file__).parents[1] / "fixtures"
GIB = 2**30
ALICE = "5GrwvaEF5zXb26Fz9rcQpDWS57CtERHpNehXCPcNoHGKutQY"
BOB = "5FHneW46xGXgs5mUiveU4sbTyGBzmstUspZC92UhjJM694ty"
CHARLIE = "5FLSigC9HGRKVhB9FiEo4Y3koPsNmBmLJbpXg2mp1hXcS59Y"
MINER_KEY = "engy-mk-0123456789abcdefk3Pq"
QWEN = QWEN36_35B_A3B.id
RIG = "4xRTX4090,1xRTX5090"


# ---- fixtures shared with the TUI's tests --------------------------------------------------------


def make_wallet(
    root: Path,
    name: str,
    hotkeys: dict[str, str],
    *,
    coldkey: str = BOB,
    public_files: bool = True,
    encrypted: frozenset[str] = frozenset(),
) -> None:
    """A wallet in bittensor's layout with made-up (but well-formed) keyfiles: `coldkey` is an
    encrypted blob, `coldkeypub.txt` and `hotkeys/HKpub.txt` public JSON, `hotkeys/HK` a JSON
    keyfile (or an encrypted blob for the names in `encrypted`)."""
    hotkeys_dir = root / name / "hotkeys"
    hotkeys_dir.mkdir(parents=True)
    (root / name / "coldkey").write_bytes(b"$NACL" + bytes(range(64)))
    (root / name / "coldkeypub.txt").write_text(json.dumps({"ss58Address": coldkey, "cryptoType": 1}))
    for hotkey, ss58 in hotkeys.items():
        if hotkey in encrypted:
            (hotkeys_dir / hotkey).write_bytes(b"$NACL" + bytes(range(64)))
        else:
            (hotkeys_dir / hotkey).write_text(
                json.dumps({"ss58Address": ss58, "secretPhrase": "made up", "cryptoType": 1})
            )
        if public_files:
            (hotkeys_dir / f"{hotkey}pub.txt").write_text(json.dumps({"ss58Address": ss58, "cryptoType": 1}))


def make_qwen_checkpoint(directory: Path) -> Path:
    """Qwen3.6's config.json with a sparse 35.1 GB shard: enough to plan, nothing to load."""
    directory.mkdir(parents=True)
    (directory / "config.json").write_bytes((FIXTURES / "qwen3.6-35b-a3b-fp8" / "config.json").read_bytes())
    with (directory / "model.safetensors").open("wb") as shard:
        shard.truncate(35_100_000_000)
    return directory


def rig(spec: str = RIG, **kwargs):
    return detect(nvml=FakeNvml.from_spec(spec, **kwargs))


def no_gpu():
    return detect(nvml=FakeNvml([], init_error=pynvml.NVMLError_LibraryNotFound))


@pytest.fixture
def qwen_checkpoint(tmp_path) -> Path:
    return make_qwen_checkpoint(tmp_path / "qwen")


# ---- the machine line ---------------------------------------------------------------------------


def test_the_machine_line_groups_gpus_and_names_p2p_driver_cuda_and_memory():
    assert machine_line(rig(), ram_bytes=125 * GIB) == (
        "4 × RTX 4090 (24 GiB, PCIe 4.0 x16) + 1 × RTX 5090 (32 GiB, PCIe 5.0 x16) · no P2P · driver 570.133.07 · "
        "CUDA 12.8 · 125 GiB RAM"
    )
    assert (
        machine_line(rig("2xRTX4090", p2p_ok=True))
        == "2 × RTX 4090 (24 GiB, PCIe 4.0 x16) · P2P · driver 570.133.07 · CUDA 12.8"
    )
    assert machine_line(rig("RTX5090")) == "1 × RTX 5090 (32 GiB, PCIe 5.0 x16) · driver 570.133.07 · CUDA 12.8"


def test_a_card_on_a_narrower_link_shows_both_widths():
    riser = dataclasses.replace(FAKE_GPU_MODELS["RTX4090"], pcie_width=8)
    inventory = detect(nvml=FakeNvml([FAKE_GPU_MODELS["RTX4090"], riser]))
    assert machine_line(inventory).startswith("2 × RTX 4090 (24 GiB, PCIe 4.0 x16/x8) · no P2P")


def test_without_a_gpu_the_machine_line_says_cpu_mode_and_why():
    assert machine_line(no_gpu(), ram_bytes=16 * GIB) == (
        "no NVIDIA GPU — CPU mode: no NVIDIA driver found (libnvidia-ml.so not loadable) · 16 GiB RAM"
    )


# ---- wallets ------------------------------------------------------------------------------------


def test_wallets_are_listed_by_name_with_their_hotkeys_addresses(tmp_path):
    make_wallet(tmp_path, "default", {"miner1": ALICE, "miner2": CHARLIE})
    make_wallet(tmp_path, "cold", {}, coldkey=CHARLIE)
    (tmp_path / "not-a-wallet").mkdir()
    (tmp_path / "stray.txt").write_text("x")

    assert list_wallets(tmp_path) == [
        WalletEntry("cold", CHARLIE, ()),
        WalletEntry("default", BOB, (HotkeyEntry("miner1", ALICE), HotkeyEntry("miner2", CHARLIE))),
    ]


def test_a_hotkey_without_a_public_file_is_read_from_its_unencrypted_keyfile(tmp_path):
    make_wallet(tmp_path, "default", {"miner1": ALICE}, public_files=False)
    assert list_wallets(tmp_path)[0].hotkeys == (HotkeyEntry("miner1", ALICE),)


def test_an_encrypted_hotkey_is_flagged_and_its_address_comes_only_from_its_public_file(tmp_path):
    make_wallet(tmp_path, "with-pub", {"hk": ALICE}, encrypted=frozenset({"hk"}))
    make_wallet(tmp_path, "without-pub", {"hk": ALICE}, encrypted=frozenset({"hk"}), public_files=False)
    by_name = {wallet.name: wallet.hotkeys for wallet in list_wallets(tmp_path)}
    assert by_name == {
        "with-pub": (HotkeyEntry("hk", ALICE, encrypted=True),),
        "without-pub": (HotkeyEntry("hk", None, encrypted=True),),
    }


def test_listing_never_opens_a_coldkey(tmp_path, monkeypatch):
    make_wallet(tmp_path, "default", {"miner1": ALICE})
    opened: list[str] = []
    original_open = Path.open

    def recording_open(self, *args, **kwargs):
        opened.append(self.name)
        return original_open(self, *args, **kwargs)

    monkeypatch.setattr(Path, "open", recording_open)  # read_text and read_bytes open through it
    list_wallets(tmp_path)
    assert "coldkey" not in opened and "coldkeypub.txt" in opened


def test_a_missing_or_unreadable_wallets_directory_lists_nothing(tmp_path):
    assert list_wallets(tmp_path / "absent") == []
    (tmp_path / "file").write_text("x")
    assert list_wallets(tmp_path / "file") == []


def test_a_wallet_bittensor_created_is_listed_with_the_address_the_node_signs_with(tmp_path):
    ss58 = keys.create_wallet(tmp_path, "default", "miner1")
    assert list_wallets(tmp_path)[0].hotkeys == (HotkeyEntry("miner1", ss58),)
    assert keys.load_hotkey(tmp_path, "default", "miner1").ss58_address == ss58


def test_short_ss58_keeps_both_ends():
    assert short_ss58(ALICE) == "5Grw…utQY"
    assert short_ss58(None) == "address unknown"
    assert short_ss58("5Abc") == "5Abc"


# ---- models -------------------------------------------------------------------------------------


def by_id(choices):
    return {choice.id: choice for choice in choices}


def test_on_the_rig_the_planned_model_fits_and_is_recommended(qwen_checkpoint):
    choices = by_id(model_choices(rig(), checkpoints={QWEN: str(qwen_checkpoint)}))

    assert list(choices) == list(CATALOG)
    qwen = choices[QWEN]
    assert (qwen.fits, qwen.mark, qwen.recommended, qwen.checkpoint) == (True, "✔", True, str(qwen_checkpoint))
    assert qwen.verdict == "fits: tp 4, mem-fraction 0.83, 8 concurrent, FP8 KV, 262144 context"
    assert any(reason.startswith("tp: 4: the smallest tensor-parallel size") for reason in qwen.reasons)
    assert any(reason.startswith("dp: 1: 5 GPUs / tp 4; GPU 4 stays idle") for reason in qwen.reasons)
    assert (choices[SMOLLM2_135M.id].fits, choices[SMOLLM2_135M.id].recommended) == (True, False)
    assert choices[SMOLLM2_135M.id].verdict == "fits: the embedded model runs on any GPU"


def test_a_gpu_model_without_its_checkpoint_asks_for_it_rather_than_guessing():
    glm = by_id(model_choices(rig()))[GLM_52.id]
    assert (glm.fits, glm.mark, glm.verdict, glm.recommended) == (None, "?", CHECKPOINT_NEEDED, False)
    assert any(GLM_52.hf_repo in reason for reason in glm.reasons)


def test_a_model_too_big_for_the_gpus_says_why_with_the_planners_words(qwen_checkpoint):
    qwen = by_id(model_choices(rig("RTX4090"), checkpoints={QWEN: str(qwen_checkpoint)}))[QWEN]
    assert (qwen.fits, qwen.mark) == (False, "✘")
    assert qwen.verdict.startswith("does not fit: 32.7 GiB of weights need at least 2 GPUs of 24.0 GiB")


def test_data_parallel_replicas_show_in_the_verdict(qwen_checkpoint):
    qwen = by_id(model_choices(rig("8xRTX4090"), checkpoints={QWEN: str(qwen_checkpoint)}))[QWEN]
    assert qwen.verdict == "fits: tp 4 × dp 2, mem-fraction 0.83, 16 concurrent, FP8 KV, 262144 context"


def test_in_cpu_mode_only_the_embedded_model_fits(qwen_checkpoint):
    choices = by_id(model_choices(no_gpu(), checkpoints={QWEN: str(qwen_checkpoint)}))

    smollm = choices[SMOLLM2_135M.id]
    assert (smollm.fits, smollm.recommended) == (True, True)
    assert smollm.verdict == "fits: the embedded model runs on this machine's CPU (the reference server)"
    assert choices[QWEN].fits is False and "no NVIDIA GPU found" in choices[QWEN].verdict
    assert choices[GLM_52.id].verdict == "does not fit: no NVIDIA GPU (in CPU mode only the embedded model runs)"


def test_the_embedded_model_with_its_checkpoint_gets_the_cpu_plan(tmp_path):
    directory = tmp_path / "smollm2"
    directory.mkdir()
    (directory / "config.json").write_bytes((FIXTURES / "smollm2-135m" / "config.json").read_bytes())
    with (directory / "model.safetensors").open("wb") as shard:
        shard.truncate(269_060_552)
    smollm = by_id(model_choices(no_gpu(), checkpoints={SMOLLM2_135M.id: str(directory)}))[SMOLLM2_135M.id]
    assert smollm.verdict == "fits: CPU mode, the reference server, 4 concurrent, 8192 context"


def test_an_unreadable_checkpoint_is_named_not_planned(tmp_path):
    qwen = by_id(model_choices(rig(), checkpoints={QWEN: str(tmp_path / "nowhere")}))[QWEN]
    assert qwen.fits is None and qwen.verdict.startswith("checkpoint unreadable: ") and "config.json" in qwen.verdict


def test_nothing_is_recommended_when_nothing_fits():
    choices = model_choices(no_gpu(), catalog={GLM_52.id: GLM_52})
    assert [(choice.fits, choice.recommended) for choice in choices] == [(False, False)]


# ---- answers ------------------------------------------------------------------------------------


def test_a_first_run_starts_from_the_public_defaults():
    answers = answers_from({})
    assert answers == SetupAnswers()
    assert (answers.role, answers.model, answers.gateway_url) == ("miner", SMOLLM2_135M.id, DEFAULT_GATEWAY_URL)
    assert answers.wallets_path == "~/.bittensor/wallets"


def test_running_setup_again_starts_from_what_node_toml_says():
    existing = {
        "miner": {
            "model": QWEN,
            "checkpoint": "/models/qwen",
            "gateway_url": "wss://gw.example/gw",
            "miner_key": MINER_KEY,
            "wallets_path": "/w",
            "wallet_name": "default",
            "wallet_hotkey": "miner1",
        }
    }
    assert answers_from(existing) == SetupAnswers(
        role="miner",
        model=QWEN,
        checkpoint="/models/qwen",
        gateway_url="wss://gw.example/gw",
        miner_key=MINER_KEY,
        wallets_path="/w",
        wallet_name="default",
        wallet_hotkey="miner1",
    )


def test_a_node_toml_naming_only_a_validator_hotkey_starts_as_a_validator():
    answers = answers_from({"validator": {"wallet_name": "v", "wallet_hotkey": "hk", "network": "test"}})
    assert (answers.role, answers.wallet_name, answers.wallet_hotkey, answers.network) == (
        "validator",
        "v",
        "hk",
        "test",
    )


def test_values_of_the_wrong_type_or_unknown_models_fall_back_to_defaults():
    answers = answers_from({"miner": {"model": "gpt-9", "miner_key": 42, "wallet_name": ["x"]}, "gateway": "oops"})
    assert (answers.model, answers.miner_key, answers.wallet_name) == (SMOLLM2_135M.id, "", "")


def test_the_miner_key_stays_out_of_the_answers_repr():
    assert MINER_KEY not in repr(SetupAnswers(miner_key=MINER_KEY))


# ---- validation ---------------------------------------------------------------------------------


GOOD_MINER = SetupAnswers(role="miner", model=QWEN, checkpoint="/models/qwen", miner_key=MINER_KEY)
GOOD_VALIDATOR = SetupAnswers(role="validator", wallet_name="default", wallet_hotkey="validator")


@pytest.mark.parametrize(
    "answers",
    [
        GOOD_MINER,
        dataclasses.replace(GOOD_MINER, miner_key="", wallet_name="default", wallet_hotkey="miner1"),
        dataclasses.replace(GOOD_MINER, gateway_url="ws://127.0.0.1:8081/gw"),
        dataclasses.replace(GOOD_MINER, gateway_url="ws://localhost:8081/gw"),
        SetupAnswers(role="miner", miner_key=MINER_KEY),
        GOOD_VALIDATOR,
        dataclasses.replace(GOOD_VALIDATOR, network="ws://127.0.0.1:9944"),
        SetupAnswers(role="gateway"),
        SetupAnswers(role="gateway", model=QWEN, checkpoint="/models/qwen"),
        SetupAnswers(role="local", gateway_url="", miner_key="", master_hotkey=""),
    ],
)
def test_complete_answers_have_no_problems(answers):
    assert validate(answers) == []


@pytest.mark.parametrize(
    ("answers", "problem"),
    [
        (
            dataclasses.replace(GOOD_MINER, gateway_url="ws://gw.example.com/gw"),
            "plain ws:// sends the miner key unencrypted; use wss://",
        ),
        (dataclasses.replace(GOOD_MINER, gateway_url="https://gw.example.com"), "use the gateway's wss:// URL"),
        (dataclasses.replace(GOOD_MINER, gateway_url=""), "gateway URL is empty"),
        (dataclasses.replace(GOOD_MINER, gateway_url="wss://gw example/gw"), "has spaces or control characters"),
        (
            dataclasses.replace(GOOD_MINER, miner_key=""),
            "a miner needs a miner key (issued by the gateway operator) or a registered hotkey",
        ),
        (dataclasses.replace(GOOD_MINER, miner_key="engy-mk-abc\n"), "the miner key has spaces, line breaks"),
        (dataclasses.replace(GOOD_MINER, checkpoint=""), f"model {QWEN} needs its checkpoint"),
        (dataclasses.replace(GOOD_MINER, model="gpt-9"), "model 'gpt-9' is not in the catalog"),
        (dataclasses.replace(GOOD_MINER, wallet_name="default"), "choose both a wallet and one of its hotkeys"),
        (dataclasses.replace(GOOD_MINER, wallet_name="a/b", wallet_hotkey="hk"), "wallet name 'a/b': use a plain name"),
        (
            dataclasses.replace(
                GOOD_MINER,
                wallet_name="w",
                wallet_hotkey="..",
            ),
            "hotkey name '..': use a plain name",
        ),
        (
            dataclasses.replace(GOOD_MINER, wallet_name="w", wallet_hotkey="hk", wallets_path=" "),
            "wallets path is empty",
        ),
        (dataclasses.replace(GOOD_VALIDATOR, wallet_hotkey=""), "a validator signs weights with its own hotkey"),
        (
            dataclasses.replace(GOOD_VALIDATOR, network="mainnet"),
            "network 'mainnet': use finney, test, local or a ws(s):// URL",
        ),
        (
            dataclasses.replace(GOOD_VALIDATOR, provider_url="provider.engy.ai"),
            "provider URL 'provider.engy.ai': use the provider's https:// URL",
        ),
        (
            dataclasses.replace(GOOD_VALIDATOR, master_hotkey="0xabc"),
            "master hotkey '0xabc': enter the provider's master hotkey",
        ),
        (SetupAnswers(role="gateway", model=QWEN), f"model {QWEN} needs its checkpoint"),
        (SetupAnswers(role="gateway", model=QWEN, checkpoint="/a,b"), "checkpoint path has a comma"),
        (dataclasses.replace(GOOD_MINER, role="farmer"), "role 'farmer': choose miner, validator, gateway or local"),
    ],
)
def test_each_problem_names_the_fix(answers, problem):
    problems = validate(answers)
    assert any(problem in found for found in problems), problems


def test_a_model_that_does_not_fit_this_machine_is_a_problem_for_a_miner(qwen_checkpoint):
    choices = model_choices(rig("RTX4090"), checkpoints={QWEN: str(qwen_checkpoint)})
    problems = validate(dataclasses.replace(GOOD_MINER, checkpoint=str(qwen_checkpoint)), choices)
    assert problems == [
        f"model {QWEN} does not fit this machine (32.7 GiB of weights need at least 2 GPUs of 24.0 GiB "
        "(each holds 19.9 GiB of weights and KV cache at --mem-fraction-static 0.83); found 1): "
        "choose a model marked ✔"
    ]


def test_every_problem_is_reported_at_once():
    answers = SetupAnswers(role="miner", model=QWEN, gateway_url="http://x", miner_key="")
    assert len(validate(answers)) == 3


# ---- node.toml ----------------------------------------------------------------------------------


EXISTING = {
    "node": {"log_level": "debug"},
    "serve": {"port": 8000},
    "miner": {"worker_name": "rig-a", "miner_key": "engy-mk-old-key-00000000", "context_length": 131072},
    "validator": {"poll_s": 60.0},
}


def parsed_config(tmp_path: Path, text: str):
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    (home / "node.toml").write_text(text)
    return load_config(home=home, env={})


def test_node_toml_writes_the_miners_answers_and_keeps_everything_else(tmp_path):
    answers = dataclasses.replace(GOOD_MINER, wallet_name="default", wallet_hotkey="miner1", wallets_path="/w")
    text = node_toml(answers, EXISTING)

    assert text.startswith(NODE_TOML_HEADER)
    document = tomllib.loads(text)
    assert document["node"] == {"log_level": "debug"} and document["serve"] == {"port": 8000}
    assert document["validator"] == {"poll_s": 60.0}
    assert document["miner"] == {
        "worker_name": "rig-a",
        "miner_key": MINER_KEY,
        "context_length": 131072,
        "model": QWEN,
        "checkpoint": "/models/qwen",
        "gateway_url": DEFAULT_GATEWAY_URL,
        "wallets_path": "/w",
        "wallet_name": "default",
        "wallet_hotkey": "miner1",
    }
    config = parsed_config(tmp_path, text)
    assert (config.miner.model, config.miner.miner_key, config.miner.worker_name) == (QWEN, MINER_KEY, "rig-a")
    assert (config.serve.port, config.node.log_level, config.validator.poll_s) == (8000, "debug", 60.0)


def test_node_toml_for_a_validator_writes_only_the_validator_section(tmp_path):
    text = node_toml(GOOD_VALIDATOR, EXISTING)
    document = tomllib.loads(text)
    assert document["miner"] == EXISTING["miner"]
    assert document["validator"] == {"poll_s": 60.0, **decided_settings(GOOD_VALIDATOR, EXISTING)["validator"]}
    config = parsed_config(tmp_path, text)
    assert (config.validator.wallet_name, config.validator.wallet_hotkey) == ("default", "validator")


def test_a_gateway_serves_the_chosen_model_and_keeps_other_models_checkpoints(tmp_path):
    existing = {"gateway": {"models": "smollm2-135m,glm-5.2", "checkpoints": "glm-5.2=/m/glm,qwen3.6-35b-a3b=/old"}}
    text = node_toml(SetupAnswers(role="gateway", model=QWEN, checkpoint="/m/qwen"), existing)
    assert tomllib.loads(text)["gateway"] == {"models": QWEN, "checkpoints": "glm-5.2=/m/glm,qwen3.6-35b-a3b=/m/qwen"}
    assert parsed_config(tmp_path, text).gateway.models == QWEN


def test_a_local_network_needs_no_settings():
    assert decided_settings(SetupAnswers(role="local"), EXISTING) == {}
    assert tomllib.loads(node_toml(SetupAnswers(role="local"), EXISTING)) == EXISTING
    assert node_toml(SetupAnswers(role="local"), {}) == NODE_TOML_HEADER


def test_strings_with_quotes_backslashes_and_control_characters_survive(tmp_path):
    awkward = 'C:\\models\\"qwen"\t\x00\x7f é ☃ \n'
    text = node_toml(dataclasses.replace(GOOD_MINER, checkpoint=awkward), {})
    assert tomllib.loads(text)["miner"]["checkpoint"] == awkward
    assert parsed_config(tmp_path, text).miner.checkpoint == awkward


def test_the_preview_masks_every_secret_and_keeps_empty_ones_empty():
    existing = {"gateway": {"admin_token": "tok-0123456789abcdef"}, "miner": {"miner_key": "engy-mk-old-key-00000000"}}
    preview = preview_toml(GOOD_MINER, existing)
    assert MINER_KEY not in preview and "tok-0123456789abcdef" not in preview
    assert 'miner_key = "●●●●k3Pq"' in preview and 'admin_token = "●●●●cdef"' in preview
    assert 'miner_key = ""' in preview_toml(dataclasses.replace(GOOD_MINER, miner_key=""), {})


def test_values_toml_cannot_hold_are_refused():
    with pytest.raises(TypeError, match="cannot write object"):
        dumps_toml({"x": object()})


# ---- node.toml by hypothesis --------------------------------------------------------------------

# Anything a person can type or paste (no lone surrogates: they are not text and no terminal sends them).
TEXT = st.text(st.characters(blacklist_categories=("Cs",)), max_size=24)
NAME = st.from_regex(r"[A-Za-z0-9_.-]{1,12}", fullmatch=True).filter(lambda name: name not in (".", ".."))
ANY_ANSWERS = st.builds(
    SetupAnswers,
    role=st.sampled_from(ROLES),
    model=st.sampled_from(list(CATALOG)),
    checkpoint=TEXT,
    wallets_path=TEXT,
    wallet_name=TEXT,
    wallet_hotkey=TEXT,
    gateway_url=TEXT,
    miner_key=TEXT,
    network=TEXT,
    provider_url=TEXT,
    master_hotkey=TEXT,
)
PRINTABLE_WORD = st.text(
    st.characters(blacklist_categories=("Cs", "Cc", "Cf", "Zs", "Zl", "Zp", "Co", "Cn")), min_size=1, max_size=24
)
VALID_ANSWERS = st.builds(
    SetupAnswers,
    role=st.sampled_from(ROLES),
    model=st.sampled_from(list(CATALOG)),
    checkpoint=TEXT.filter(lambda text: "," not in text).map(lambda text: "/models/" + text),
    wallets_path=TEXT.map(lambda text: "~/" + text),
    wallet_name=NAME,
    wallet_hotkey=NAME,
    gateway_url=st.tuples(
        st.sampled_from(["wss://api.engy.ai/gw", "ws://127.0.0.1:8081/gw", "wss://[::1]/"]),
        st.from_regex(r"[a-z0-9/]{0,8}", fullmatch=True),
    ).map("".join),
    miner_key=PRINTABLE_WORD | st.just(""),
    network=st.sampled_from(["finney", "test", "local", "ws://127.0.0.1:9944"]),
    provider_url=st.from_regex(r"https?://[a-z.]{1,12}(:[0-9]{1,4})?", fullmatch=True),
    master_hotkey=st.sampled_from([ALICE, BOB, CHARLIE]),
)
SCALARS = st.one_of(
    st.booleans(),
    st.integers(min_value=-(2**63), max_value=2**63 - 1),
    st.floats(allow_nan=False),
    TEXT,
    st.dates(),
    st.times(),
    st.datetimes(timezones=st.none() | st.just(datetime.UTC)),
)
TOML_VALUES = st.recursive(
    SCALARS, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(TEXT, inner, max_size=3), max_leaves=8
)
ANY_EXISTING = st.dictionaries(TEXT, st.dictionaries(TEXT, TOML_VALUES, max_size=4) | TOML_VALUES, max_size=4)
VALID_EXISTING = st.fixed_dictionaries(
    {},
    optional={
        "node": st.fixed_dictionaries(
            {}, optional={"log_level": st.sampled_from(["debug", "info", "warning", "error"])}
        ),
        "serve": st.fixed_dictionaries({}, optional={"port": st.integers(0, 65535), "served_model_name": TEXT}),
        "miner": st.fixed_dictionaries(
            {},
            optional={
                "worker_name": TEXT,
                "max_inflight": st.integers(0, 512),
                "miner_key": TEXT,
                "model": st.sampled_from(list(CATALOG)),
            },
        ),
        "gateway": st.fixed_dictionaries({}, optional={"verifiers": TEXT, "keepalive_s": st.floats(0.1, 60)}),
        "validator": st.fixed_dictionaries({}, optional={"poll_s": st.floats(1, 1000), "wallet_name": TEXT}),
    },
)


def documents_equal(a, b) -> bool:
    """Equality that reads -0.0 and 0.0 as TOML does (both are written and read back faithfully,
    but compare as equal anyway) and compares nested lists and tables element by element."""
    if isinstance(a, float) and isinstance(b, float):
        return a == b and math.copysign(1, a) == math.copysign(1, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(documents_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, list):
        return len(a) == len(b) and all(documents_equal(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


@given(document=ANY_EXISTING)
def test_any_document_toml_can_hold_reads_back_equal(document):
    assert documents_equal(tomllib.loads(dumps_toml(document)), document)


@given(answers=ANY_ANSWERS, existing=ANY_EXISTING)
def test_any_answers_over_any_node_toml_parse_and_set_exactly_what_setup_decides(answers, existing):
    document = tomllib.loads(node_toml(answers, existing))
    decided = decided_settings(answers, existing)
    for section, values in decided.items():
        assert {key: document[section][key] for key in values} == values
    for name, value in existing.items():
        if name not in decided:
            assert documents_equal(document[name], value)
        elif isinstance(value, dict):
            kept = {key: item for key, item in value.items() if key not in decided[name]}
            assert documents_equal({key: document[name][key] for key in kept}, kept)


@settings(suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(answers=VALID_ANSWERS, existing=VALID_EXISTING)
def test_answers_that_validate_load_through_the_real_config_loader_unchanged(answers, existing):
    assume(validate(answers) == [])
    with tempfile.TemporaryDirectory() as home:
        Path(home, "node.toml").write_text(node_toml(answers, existing), encoding="utf-8")
        config = load_config(home=home, env={})
    for section, values in decided_settings(answers, existing).items():
        assert {key: getattr(getattr(config, section), key) for key in values} == values
    for section, values in existing.items():
        for key, value in values.items():
            if key not in decided_settings(answers, existing).get(section, {}):
                assert getattr(getattr(config, section), key) == value


# ---- commands -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("answers", "expected"),
    [
        (GOOD_MINER, ["engy-node plan", "engy-node --role miner"]),
        (GOOD_VALIDATOR, ["engy-node --role validator --validator-wallet default --validator-hotkey validator"]),
        (SetupAnswers(role="gateway"), ["engy-node --role gateway"]),
        (SetupAnswers(role="local"), ["engy-node up --traffic"]),
    ],
)
def test_the_commands_are_the_clis_exact_forms(answers, expected):
    assert commands(answers) == expected


def test_a_home_is_passed_before_the_subcommand_and_quoted():
    assert commands(GOOD_MINER, home="/srv/my node") == [
        "engy-node --home '/srv/my node' plan",
        "engy-node --home '/srv/my node' --role miner",
    ]
    assert commands(SetupAnswers(role="local"), home="/h") == ["engy-node --home /h up --traffic"]


@given(answers=ANY_ANSWERS, key=st.text(st.characters(blacklist_categories=("Cs",)), min_size=12, max_size=40))
def test_secrets_never_reach_the_commands_or_the_preview(answers, key):
    answers = dataclasses.replace(answers, miner_key=key)
    assert commands(answers) == commands(dataclasses.replace(answers, miner_key=""))
    preview = preview_toml(answers, {"miner": {"miner_key": key}})
    assert tomllib.loads(preview).get("miner", {}).get("miner_key") == "●●●●" + key[-4:]


# ---- reading and writing ------------------------------------------------------------------------


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_a_first_write_creates_the_directory_and_a_private_file(tmp_path):
    path = tmp_path / "config" / "engy" / "node.toml"
    assert write_node_toml(path, "x = 1\n") is None
    assert path.read_text() == "x = 1\n" and mode(path) == 0o600
    assert sorted(p.name for p in path.parent.iterdir()) == ["node.toml"], "no temporary file is left behind"


def test_rewriting_keeps_the_previous_file_as_a_private_backup(tmp_path):
    path = tmp_path / "node.toml"
    path.write_text("# mine\nold = true\n")
    os.chmod(path, 0o644)
    backup = write_node_toml(path, "new = true\n")
    assert backup == tmp_path / "node.toml.bak"
    assert backup.read_text() == "# mine\nold = true\n" and mode(backup) == 0o600
    assert path.read_text() == "new = true\n" and mode(path) == 0o600
    assert sorted(p.name for p in tmp_path.iterdir()) == ["node.toml", "node.toml.bak"]


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path, monkeypatch):
    path = tmp_path / "node.toml"
    path.write_text("old = true\n")

    def refuse(*args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", refuse)
    with pytest.raises(OSError, match="No space left"):
        write_node_toml(path, "new = true\n")
    assert path.read_text() == "old = true\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["node.toml"]


def test_reading_node_toml(tmp_path):
    assert read_existing(tmp_path / "absent.toml") == {}
    (tmp_path / "ok.toml").write_text("[serve]\nport = 1\n")
    assert read_existing(tmp_path / "ok.toml") == {"serve": {"port": 1}}
    (tmp_path / "broken.toml").write_text("[serve\n")
    with pytest.raises(ConfigError, match=r"broken\.toml: not valid TOML .*fix the file or move it aside"):
        read_existing(tmp_path / "broken.toml")


def test_gather_facts_reads_the_homes_node_toml_and_the_gpus(tmp_path):
    (tmp_path / "node.toml").write_text(
        '[miner]\nmodel = "qwen3.6-35b-a3b"\ncheckpoint = "/m/qwen"\nwallets_path = "/w"\n'
        '[gateway]\ncheckpoints = "glm-5.2=/m/glm"\n'
    )
    facts = gather_facts(str(tmp_path), env={}, nvml=FakeNvml.from_spec("2xRTX4090"))
    assert facts.config_file == tmp_path.resolve() / "node.toml" and facts.home == str(tmp_path)
    assert facts.existing["miner"]["model"] == QWEN and facts.wallets_path == "/w"
    assert facts.checkpoints == {"glm-5.2": "/m/glm", QWEN: "/m/qwen"}
    assert len(facts.inventory.gpus) == 2 and facts.ram_bytes and facts.ram_bytes > 0
