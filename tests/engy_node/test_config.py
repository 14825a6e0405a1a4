"""Tests for engy_node.config: defaults, the layer order, the `--home` layout, typo suggestions,
type coercion from environment strings, and validation."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import platformdirs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engy_node.config import (
    MAX_GATEWAY_WORKERS,
    Config,
    NodeSection,
    ServeSection,
    config_document,
    config_from_document,
    load_config,
    resolve_paths,
)
from engy_node.errors import ConfigError, EngyError


def write_toml(home: Path, text: str) -> Path:
    home.mkdir(parents=True, exist_ok=True)
    path = home / "node.toml"
    path.write_text(text, encoding="utf-8")
    return path


# --- defaults ---------------------------------------------------------------------------------


def test_with_no_file_no_env_and_no_flags_every_setting_is_its_default(tmp_path):
    config = load_config(home=tmp_path, env={})
    assert isinstance(config, Config)
    assert config.node == NodeSection()
    assert config.serve == ServeSection()
    assert config.node.netuid == 53
    assert config.node.log_level == "info"
    assert config.serve.model == "smollm2-135m"
    assert config.serve.port == 30000
    assert config.serve.host == "127.0.0.1"
    assert config.serve.max_running_requests == 8
    assert config.serve.enable_return_hidden_states is True
    assert config.serve.stream_hidden_states == "cumulative"


def test_the_config_sections_are_immutable(tmp_path):
    config = load_config(home=tmp_path, env={})
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.serve.port = 1  # type: ignore[misc]


# --- layer precedence -------------------------------------------------------------------------


def test_a_setting_in_the_file_replaces_the_default(tmp_path):
    write_toml(tmp_path, "[serve]\nport = 8100\nmodel = 'qwen3.6-35b-a3b'\n[node]\nlog_level = 'debug'\n")
    config = load_config(home=tmp_path, env={})
    assert config.serve.port == 8100
    assert config.serve.model == "qwen3.6-35b-a3b"
    assert config.node.log_level == "debug"
    # Settings the file does not name keep their defaults.
    assert config.serve.host == "127.0.0.1"


def test_the_environment_overrides_the_file(tmp_path):
    write_toml(tmp_path, "[serve]\nport = 8100\nhost = '0.0.0.0'\n")
    config = load_config(home=tmp_path, env={"ENGY_SERVE__PORT": "8200"})
    assert config.serve.port == 8200
    assert config.serve.host == "0.0.0.0"


def test_flags_override_the_environment_and_the_file(tmp_path):
    write_toml(tmp_path, "[serve]\nport = 8100\n")
    config = load_config(home=tmp_path, env={"ENGY_SERVE__PORT": "8200"}, overrides={"serve": {"port": 8300}})
    assert config.serve.port == 8300


def test_a_flag_left_unset_as_none_does_not_override_lower_layers(tmp_path):
    write_toml(tmp_path, "[serve]\nhost = '10.0.0.1'\n")
    config = load_config(
        home=tmp_path,
        env={"ENGY_SERVE__PORT": "8200"},
        overrides={"serve": {"port": None, "host": None, "max_running_requests": 3}},
    )
    assert config.serve.port == 8200
    assert config.serve.host == "10.0.0.1"
    assert config.serve.max_running_requests == 3


def test_environment_variable_names_are_case_insensitive_after_the_prefix(tmp_path):
    config = load_config(home=tmp_path, env={"ENGY_serve__Max_Running_Requests": "5"})
    assert config.serve.max_running_requests == 5


def test_unrelated_environment_variables_are_ignored(tmp_path):
    env = {"PATH": "/usr/bin", "ENGYX_SERVE__PORT": "1", "ENGY_SOMETHING": "x", "HOME": "/root"}
    config = load_config(home=tmp_path, env=env)
    assert config.serve.port == 30000


# --- where things live ------------------------------------------------------------------------


def test_home_puts_the_config_file_in_home_and_the_data_in_home_data(tmp_path):
    config = load_config(home=tmp_path, env={})
    home = tmp_path.resolve()
    assert config.paths.config_file == home / "node.toml"
    assert config.paths.data_dir == home / "data"
    assert config.paths.log_dir == home / "data" / "logs"
    assert config.paths.models_dir == home / "data" / "models"


def test_home_does_not_relocate_the_shared_model_cache(tmp_path):
    with_home = load_config(home=tmp_path / "a", env={})
    other_home = load_config(home=tmp_path / "b", env={})
    expected = Path(platformdirs.user_cache_dir("engy")) / "models"
    assert with_home.paths.model_cache_dir == expected
    assert other_home.paths.model_cache_dir == expected
    assert not with_home.paths.model_cache_dir.is_relative_to(tmp_path)


def test_engy_model_cache_moves_the_model_cache(tmp_path):
    cache = tmp_path / "cache"
    config = load_config(home=tmp_path / "home", env={"ENGY_MODEL_CACHE": str(cache)})
    assert config.paths.model_cache_dir == cache
    assert config.paths.data_dir == (tmp_path / "home").resolve() / "data"


def test_engy_home_in_the_environment_acts_like_the_home_flag(tmp_path):
    write_toml(tmp_path, "[serve]\nport = 8100\n")
    config = load_config(env={"ENGY_HOME": str(tmp_path)})
    assert config.paths.config_file == tmp_path.resolve() / "node.toml"
    assert config.serve.port == 8100


def test_the_home_argument_wins_over_engy_home(tmp_path):
    paths = resolve_paths(tmp_path / "flag", {"ENGY_HOME": str(tmp_path / "env")})
    assert paths.data_dir == (tmp_path / "flag").resolve() / "data"


def test_without_a_home_the_platform_directories_are_used():
    paths = resolve_paths(None, {})
    assert paths.config_file == Path(platformdirs.user_config_dir("engy")) / "node.toml"
    assert paths.data_dir == Path(platformdirs.user_data_dir("engy"))
    assert paths.model_cache_dir == Path(platformdirs.user_cache_dir("engy")) / "models"


def test_loading_the_config_creates_no_files(tmp_path):
    load_config(home=tmp_path / "home", env={})
    assert list(tmp_path.iterdir()) == []


# --- unknown names ----------------------------------------------------------------------------


def test_an_unknown_setting_in_the_file_suggests_the_closest_name(tmp_path):
    path = write_toml(tmp_path, "[serve]\nprot = 8000\n")
    with pytest.raises(ConfigError) as caught:
        load_config(home=tmp_path, env={})
    message = str(caught.value)
    assert str(path) in message
    assert "'prot'" in message
    assert "did you mean 'port'?" in message


def test_an_unknown_section_in_the_file_suggests_the_closest_section(tmp_path):
    path = write_toml(tmp_path, "[sevre]\nport = 8000\n")
    with pytest.raises(ConfigError) as caught:
        load_config(home=tmp_path, env={})
    message = str(caught.value)
    assert str(path) in message
    assert "unknown section 'sevre'" in message
    assert "did you mean 'serve'?" in message


def test_an_unknown_section_with_no_close_match_lists_the_known_sections(tmp_path):
    write_toml(tmp_path, "[zzzzzz]\nx = 1\n")
    with pytest.raises(ConfigError, match="known: alerts, control, gateway, miner, node, serve, validator, verifier"):
        load_config(home=tmp_path, env={})


def test_a_bare_key_at_the_top_of_the_file_is_reported_as_an_unknown_section(tmp_path):
    write_toml(tmp_path, "port = 8000\n")
    with pytest.raises(ConfigError, match="unknown section 'port'"):
        load_config(home=tmp_path, env={})


def test_a_section_name_that_is_not_a_table_is_rejected(tmp_path):
    write_toml(tmp_path, "serve = 5\n")
    with pytest.raises(ConfigError, match=r"\[serve\] must be a table"):
        load_config(home=tmp_path, env={})


def test_an_unknown_setting_in_the_environment_names_the_variable_and_suggests_the_closest_name(tmp_path):
    with pytest.raises(ConfigError) as caught:
        load_config(home=tmp_path, env={"ENGY_SERVE__MAX_RUNING_REQUESTS": "4"})
    message = str(caught.value)
    assert "$ENGY_SERVE__MAX_RUNING_REQUESTS" in message
    assert "did you mean 'max_running_requests'?" in message


def test_an_unknown_section_in_the_environment_names_the_variable_and_suggests_the_closest_section(tmp_path):
    with pytest.raises(ConfigError) as caught:
        load_config(home=tmp_path, env={"ENGY_NODES__NETUID": "1"})
    message = str(caught.value)
    assert "$ENGY_NODES__NETUID" in message
    assert "did you mean 'node'?" in message


def test_an_unknown_flag_is_reported_as_coming_from_the_command_line(tmp_path):
    with pytest.raises(ConfigError, match="command line.*did you mean 'port'"):
        load_config(home=tmp_path, env={}, overrides={"serve": {"portt": 1}})
    with pytest.raises(ConfigError, match="command line: unknown section 'srve'"):
        load_config(home=tmp_path, env={}, overrides={"srve": {"port": 1}})


def test_config_errors_are_engy_errors_with_the_config_title(tmp_path):
    write_toml(tmp_path, "[serve]\nprot = 1\n")
    with pytest.raises(EngyError) as caught:
        load_config(home=tmp_path, env={})
    assert isinstance(caught.value, ConfigError)
    assert caught.value.title == "config"


# --- a broken file ----------------------------------------------------------------------------


def test_a_file_that_is_not_valid_toml_is_named_in_the_error(tmp_path):
    path = write_toml(tmp_path, "[serve\nport = \n")
    with pytest.raises(ConfigError) as caught:
        load_config(home=tmp_path, env={})
    message = str(caught.value)
    assert str(path) in message
    assert "not valid TOML" in message


def test_a_file_that_is_not_utf8_is_named_in_the_error(tmp_path):
    tmp_path.mkdir(exist_ok=True)
    path = tmp_path / "node.toml"
    path.write_bytes(b"[serve]\nhost = '\xff\xfe'\n")
    with pytest.raises(ConfigError, match="not valid TOML") as caught:
        load_config(home=tmp_path, env={})
    assert str(path) in str(caught.value)


def test_a_value_of_the_wrong_type_in_the_file_names_the_file_and_the_setting(tmp_path):
    path = write_toml(tmp_path, "[serve]\nport = 'eight thousand'\n")
    with pytest.raises(ConfigError) as caught:
        load_config(home=tmp_path, env={})
    message = str(caught.value)
    assert str(path) in message
    assert "serve.port" in message


# --- coercion ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("1", True),
        ("true", True),
        ("TRUE", True),
        ("yes", True),
        ("On", True),
        ("0", False),
        ("false", False),
        ("False", False),
        ("no", False),
        ("OFF", False),
    ],
)
def test_a_boolean_from_the_environment_accepts_the_usual_spellings(tmp_path, raw, expected):
    config = load_config(home=tmp_path, env={"ENGY_SERVE__ENABLE_RETURN_HIDDEN_STATES": raw})
    assert config.serve.enable_return_hidden_states is expected


@pytest.mark.parametrize("raw", ["", "maybe", "2", "y", "t"])
def test_a_boolean_from_the_environment_rejects_anything_else(tmp_path, raw):
    with pytest.raises(ConfigError, match="must be true or false") as caught:
        load_config(home=tmp_path, env={"ENGY_SERVE__ENABLE_RETURN_HIDDEN_STATES": raw})
    assert "$ENGY_SERVE__ENABLE_RETURN_HIDDEN_STATES" in str(caught.value)


def test_a_boolean_in_the_file_must_be_a_toml_boolean_or_a_known_spelling(tmp_path):
    write_toml(tmp_path, "[serve]\nenable_return_hidden_states = false\n")
    assert load_config(home=tmp_path, env={}).serve.enable_return_hidden_states is False
    write_toml(tmp_path, "[serve]\nenable_return_hidden_states = 1\n")
    with pytest.raises(ConfigError, match="must be true or false"):
        load_config(home=tmp_path, env={})


@given(st.integers(min_value=0, max_value=65535), st.sampled_from(["", " ", "  "]))
@settings(max_examples=100)
def test_an_integer_from_the_environment_is_parsed_ignoring_surrounding_spaces(tmp_path_factory, port, pad):
    home = tmp_path_factory.mktemp("home")
    config = load_config(home=home, env={"ENGY_SERVE__PORT": f"{pad}{port}{pad}"})
    assert config.serve.port == port


@pytest.mark.parametrize("raw", ["eighty", "80.0", "", "0x50"])
def test_an_integer_setting_rejects_text_that_is_not_an_integer(tmp_path, raw):
    with pytest.raises(ConfigError, match=r"\$ENGY_SERVE__PORT: serve.port"):
        load_config(home=tmp_path, env={"ENGY_SERVE__PORT": raw})


def test_an_integer_setting_refuses_a_boolean(tmp_path):
    with pytest.raises(ConfigError, match="must be an integer"):
        load_config(home=tmp_path, env={}, overrides={"serve": {"port": True}})
    write_toml(tmp_path, "[serve]\nmax_running_requests = true\n")
    with pytest.raises(ConfigError, match="must be an integer"):
        load_config(home=tmp_path, env={})


def test_an_integer_setting_refuses_a_float_from_the_file(tmp_path):
    write_toml(tmp_path, "[serve]\nport = 8000.0\n")
    with pytest.raises(ConfigError, match="must be an integer"):
        load_config(home=tmp_path, env={})


def test_a_float_setting_accepts_an_integer_and_numeric_text(tmp_path):
    write_toml(tmp_path, "[serve]\nrequest_timeout_s = 5\n")
    config = load_config(home=tmp_path, env={})
    assert config.serve.request_timeout_s == 5.0
    assert isinstance(config.serve.request_timeout_s, float)
    config = load_config(home=tmp_path, env={"ENGY_SERVE__REQUEST_TIMEOUT_S": "12.5"})
    assert config.serve.request_timeout_s == 12.5


def test_a_float_setting_refuses_a_boolean_and_non_numeric_text(tmp_path):
    with pytest.raises(ConfigError, match="must be a number"):
        load_config(home=tmp_path, env={}, overrides={"serve": {"request_timeout_s": False}})
    with pytest.raises(ConfigError, match="serve.request_timeout_s"):
        load_config(home=tmp_path, env={"ENGY_SERVE__REQUEST_TIMEOUT_S": "soon"})


def test_a_string_setting_refuses_a_number_from_the_file(tmp_path):
    write_toml(tmp_path, "[serve]\nhost = 127\n")
    with pytest.raises(ConfigError, match="must be a string"):
        load_config(home=tmp_path, env={})


@pytest.mark.parametrize(
    ("value", "ok"), [("cpu", True), ("cuda", True), ("auto", True), ("gpu", False), ("CPU", False)]
)
def test_a_choice_setting_accepts_only_its_listed_values(tmp_path, value, ok):
    env = {"ENGY_SERVE__DEVICE": value}
    if ok:
        assert load_config(home=tmp_path, env=env).serve.device == value
    else:
        with pytest.raises(ConfigError) as caught:
            load_config(home=tmp_path, env=env)
        assert "must be one of 'auto', 'cpu', 'cuda'" in str(caught.value)


def test_a_rejected_choice_lists_the_allowed_values_for_every_choice_setting(tmp_path):
    cases = {
        "ENGY_NODE__LOG_LEVEL": "'debug', 'info', 'warning', 'error'",
        "ENGY_SERVE__DTYPE": "'bfloat16', 'float32', 'float16'",
        "ENGY_SERVE__STREAM_HIDDEN_STATES": "'cumulative', 'final'",
    }
    for variable, allowed in cases.items():
        with pytest.raises(ConfigError) as caught:
            load_config(home=tmp_path, env={variable: "nonsense"})
        assert allowed in str(caught.value)
        assert variable in str(caught.value)


# --- validation -------------------------------------------------------------------------------


@pytest.mark.parametrize("port", [0, 1, 65535])
def test_a_port_in_range_is_accepted_and_zero_means_any_free_port(tmp_path, port):
    assert load_config(home=tmp_path, env={}, overrides={"serve": {"port": port}}).serve.port == port


@pytest.mark.parametrize("port", [-1, 65536, 100000])
def test_a_port_outside_0_to_65535_is_rejected(tmp_path, port):
    with pytest.raises(ConfigError, match="0..65535"):
        load_config(home=tmp_path, env={"ENGY_SERVE__PORT": str(port)})


@pytest.mark.parametrize("value", [0, -3])
def test_max_running_requests_must_be_at_least_one(tmp_path, value):
    with pytest.raises(ConfigError, match="max_running_requests must be at least 1"):
        load_config(home=tmp_path, env={}, overrides={"serve": {"max_running_requests": value}})
    assert (
        load_config(home=tmp_path, env={}, overrides={"serve": {"max_running_requests": 1}}).serve.max_running_requests
        == 1
    )


def test_the_log_ring_must_hold_at_least_a_hundred_records(tmp_path):
    with pytest.raises(ConfigError, match="log_ring_size must be at least 100"):
        load_config(home=tmp_path, env={"ENGY_NODE__LOG_RING_SIZE": "99"})
    assert load_config(home=tmp_path, env={"ENGY_NODE__LOG_RING_SIZE": "100"}).node.log_ring_size == 100


def test_the_config_document_rebuilds_the_same_config(tmp_path):
    (tmp_path / "node.toml").write_text('[gateway]\nworkers = 3\nmodels = "smollm2-135m"\n[miner]\nmax_inflight = 7\n')
    config = load_config(home=tmp_path, env={"ENGY_NODE__LOG_LEVEL": "debug"}, overrides={"gateway": {"port": 0}})
    document = json.loads(json.dumps(config_document(config)))
    assert config_from_document(document) == config


@pytest.mark.parametrize("workers", [0, -1, MAX_GATEWAY_WORKERS + 1])
def test_gateway_workers_outside_the_range_are_refused_naming_the_setting(tmp_path, workers):
    with pytest.raises(ConfigError, match="gateway.workers"):
        load_config(home=tmp_path, env={}, overrides={"gateway": {"workers": workers}})


@pytest.mark.parametrize("timeout_s", [0, -1, 25.5])
def test_a_gemm_opening_timeout_the_verifier_would_not_wait_for_is_refused(tmp_path, timeout_s):
    with pytest.raises(ConfigError, match="gateway.gemm_opening_timeout_s .* at most 25 s"):
        load_config(home=tmp_path, env={}, overrides={"gateway": {"gemm_opening_timeout_s": timeout_s}})


def test_gemm_audits_are_asked_for_by_default_and_can_be_turned_off(tmp_path):
    assert load_config(home=tmp_path, env={}).gateway.gemm_audit
    off = load_config(home=tmp_path, env={"ENGY_GATEWAY__GEMM_AUDIT": "false"})
    assert not off.gateway.gemm_audit and off.gateway.gemm_opening_timeout_s == 20.0


# --- a gateway fleet --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("settings", "fix"),
    [
        ({"fleet_legs": "4"}, "gateway.store_url is empty"),
        (
            {"fleet_legs": "4", "fleet_offset": "3", "workers": "2", "store_url": "postgresql://engy@db/engy"},
            "does not fit",
        ),
        ({"fleet_offset": "2"}, "set both, or neither"),
        ({"store_url": "sqlite:///tmp/x"}, "must be a postgresql:// URL"),
    ],
)
def test_fleet_settings_that_cannot_work_are_refused_with_the_fix(tmp_path, settings, fix):
    env = {f"ENGY_GATEWAY__{name.upper()}": value for name, value in settings.items()}
    with pytest.raises(ConfigError, match=fix):
        load_config(home=tmp_path, env=env)


def test_a_fleet_host_is_configured_by_its_store_url_and_its_legs(tmp_path):
    config = load_config(
        home=tmp_path,
        env={
            "ENGY_GATEWAY__STORE_URL": "postgresql://engy:pw@db:5432/engy",
            "ENGY_GATEWAY__FLEET_LEGS": "4",
            "ENGY_GATEWAY__FLEET_OFFSET": "2",
            "ENGY_GATEWAY__WORKERS": "2",
            "ENGY_GATEWAY__HOST_NAME": "gw-b",
        },
    )
    assert (config.gateway.fleet_legs, config.gateway.fleet_offset, config.gateway.host_name) == (4, 2, "gw-b")
