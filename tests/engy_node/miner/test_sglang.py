"""The model-server command builders, the supervisor's pure decisions, and the supervisor itself
running real children: our reference server, and small scripted servers that crash, stall,
never start or ignore SIGTERM on cue.

Every child a test starts is stopped by the supervisor's own cancellation, and the tests check
that its pid is gone afterwards. Scripted children also exit by themselves after a minute, so
a failing test cannot leak one for longer.
"""

from __future__ import annotations

import logging
import os
import re
import shlex
import signal
import socket
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from engy_node.retry import backoff_delay
import trio
from hypothesis import given
from hypothesis import strategies as st

from engy_node.hub import Hub, HubHandler
from engy_node.miner.sglang import (
    LaunchSpec,
    LineBuffer,
    ModelServerError,
    ModelServerSupervisor,
    SupervisorSettings,
    classify_failure,
    detect_stall,
    reference_launch,
    sglang_launch,
    shell_command,
)
from engy_node.miner.sglang.output_lines import TRUNCATION_MARK

QWEN_PATH = "/data/models/Qwen/Qwen3.6-35B-A3B-FP8"

# The published reference command (SPEC §7.3), as one string.
PUBLISHED = (
    f"python -m sglang.launch_server --model-path {QWEN_PATH} --served-model-name Qwen3.6 --tp-size 4 "
    "--trust-remote-code --kv-cache-dtype fp8_e4m3 --mem-fraction-static 0.83 --chunked-prefill-size 8192 "
    "--max-running-requests 8 --context-length 262144 --enable-return-hidden-states --enable-cache-report "
    "--enable-metrics --host 127.0.0.1 --port 8000"
)
PUBLISHED_PLAN = dict(
    python="python", checkpoint=QWEN_PATH, served_model_name="Qwen3.6", tp=4, kv_cache_dtype="fp8_e4m3",
    mem_fraction_static=0.83, chunked_prefill_size=8192, max_running_requests=8, context_length=262144,
    host="127.0.0.1", port=8000,
)


# ---- command builders ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        pytest.param({}, PUBLISHED, id="published-4x4090"),
        pytest.param({"tp": 2, "dp": 2}, PUBLISHED.replace("--tp-size 4", "--tp-size 2 --dp-size 2"), id="dp-follows-tp"),
        pytest.param({"dp": 1}, PUBLISHED, id="dp-1-adds-no-flag"),
        pytest.param(
            {"tp": 2, "extra_flags": ("--disable-custom-all-reduce", "--attention-backend", "triton")},
            PUBLISHED.replace("--tp-size 4", "--tp-size 2") + " --disable-custom-all-reduce --attention-backend triton",
            id="extra-flags-come-last",
        ),
        pytest.param(
            {"tp": 1, "kv_cache_dtype": None, "mem_fraction_static": None, "chunked_prefill_size": None,
             "max_running_requests": None, "context_length": None},
            f"python -m sglang.launch_server --model-path {QWEN_PATH} --served-model-name Qwen3.6 --tp-size 1 "
            "--trust-remote-code --enable-return-hidden-states --enable-cache-report --enable-metrics "
            "--host 127.0.0.1 --port 8000",
            id="unset-values-leave-sglang-defaults",
        ),
        pytest.param({"chunked_prefill_size": -1}, PUBLISHED.replace("8192", "-1"), id="chunked-prefill-off"),
        pytest.param({"mem_fraction_static": 0.8333333}, PUBLISHED.replace("0.83", "0.8333333"), id="fraction-kept-exact"),
    ],
)
def test_the_sglang_command_is_the_published_reference_form_flag_for_flag(changes, expected):
    spec = sglang_launch(**{**PUBLISHED_PLAN, **changes})
    assert spec.argv == tuple(expected.split(" "))
    assert spec.kind == "sglang"
    assert spec.base_url == "http://127.0.0.1:8000"
    assert spec.health_path == "/health"
    # /health must not run a generation per liveness probe (sglang #35884).
    assert spec.env == (("SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION", "0"),)


@pytest.mark.parametrize(
    ("host", "base_url"),
    [("0.0.0.0", "http://127.0.0.1:8000"), ("::", "http://[::1]:8000"), ("10.0.0.5", "http://10.0.0.5:8000")],
)
def test_a_server_bound_to_every_interface_is_probed_over_loopback(host, base_url):
    assert sglang_launch(**{**PUBLISHED_PLAN, "host": host}).base_url == base_url


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"port": 0}, "port"),
        ({"port": 70000}, "port"),
        ({"tp": 0}, "tp"),
        ({"dp": 0}, "dp"),
        ({"mem_fraction_static": 1.0}, "mem_fraction_static"),
        ({"mem_fraction_static": 0.0}, "mem_fraction_static"),
        ({"max_running_requests": 0}, "max_running_requests"),
        ({"chunked_prefill_size": 0}, "chunked_prefill_size"),
        ({"served_model_name": ""}, "served_model_name"),
        ({"extra_flags": ("--port", "9000")}, "--port"),
        ({"extra_flags": ("--tp-size=2",)}, "--tp-size"),
    ],
)
def test_a_wrong_plan_value_is_refused_naming_the_argument(changes, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        sglang_launch(**{**PUBLISHED_PLAN, **changes})


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        pytest.param(
            dict(python="/venv/bin/python", home="/tmp/h", model="smollm2-135m", checkpoint="/ckpt", host="127.0.0.1",
                 port=30001, dtype="bfloat16", device="cpu", max_running_requests=4),
            "/venv/bin/python -m engy_node --home /tmp/h serve --model smollm2-135m --checkpoint /ckpt "
            "--host 127.0.0.1 --port 30001 --dtype bfloat16 --device cpu --max-running-requests 4",
            id="everything-set",
        ),
        pytest.param(
            dict(python="python3", home=Path("/tmp/h"), model="smollm2-135m", port=30000),
            "python3 -m engy_node --home /tmp/h serve --model smollm2-135m --host 127.0.0.1 --port 30000",
            id="defaults-left-to-the-server-config",
        ),
    ],
)
def test_the_reference_command_runs_engy_node_serve(kwargs, expected):
    spec = reference_launch(**kwargs)
    assert spec.argv == tuple(expected.split(" "))
    assert (spec.kind, spec.env, spec.health_path) == ("reference", (), "/health")
    assert spec.base_url == f"http://127.0.0.1:{kwargs['port']}"


def test_the_shell_text_of_the_published_command_is_ready_to_paste():
    assert shell_command(sglang_launch(**PUBLISHED_PLAN)) == f"SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION=0 {PUBLISHED}"


@given(
    words=st.lists(st.text(st.characters(exclude_characters="\x00"), min_size=0, max_size=12), min_size=1, max_size=6),
    value=st.text(st.characters(exclude_characters="\x00"), max_size=12),
)
def test_the_shell_text_splits_back_into_the_exact_environment_and_argv(words, value):
    spec = LaunchSpec(kind="sglang", argv=tuple(words), env=(("A_VAR", value), ("B", "x y")), base_url="http://h:1")
    assert shlex.split(shell_command(spec)) == [f"A_VAR={value}", "B=x y", *words]


def test_a_checkpoint_path_with_spaces_and_quotes_survives_the_shell_round_trip():
    spec = sglang_launch(**{**PUBLISHED_PLAN, "checkpoint": "/models/it's a \"model\" $HOME"})
    assert shlex.split(shell_command(spec))[1:] == list(spec.argv)


# ---- restart backoff -----------------------------------------------------------------------------

def test_the_default_startup_failures_give_up_after_about_fifteen_seconds_of_backoff():
    # SupervisorSettings.max_startup_failures' docstring: the waits between 5 failed starts.
    settings = SupervisorSettings()
    waits = [backoff_delay(consecutive_failures=n, jitter=0.0, base_s=settings.restart_base_s, cap_s=settings.restart_cap_s)
             for n in range(1, settings.max_startup_failures)]
    assert sum(waits) == 15.0



# ---- failure classification ----------------------------------------------------------------------

TRACEBACK = ["Traceback (most recent call last):", '  File "/sglang/srt/managers/scheduler.py", line 2300, in run_scheduler_process']


@pytest.mark.parametrize(
    ("tail", "exit_code", "phase", "detected", "kind", "fix_says"),
    [
        pytest.param(
            ["[2025-05-01 10:00:00 TP0] Load weight end. type=Qwen3MoeForCausalLM, avail mem=0.41 GB, mem usage=21.73 GB.",
             *TRACEBACK, "RuntimeError: Not enough memory. Please try to increase --mem-fraction-static."],
            1, "startup", None, "oom_at_init", "increase --mem-fraction-static", id="oom-at-init",
        ),
        pytest.param(
            ["[2025-05-01 10:00:03 TP0] max_total_tokens=600000 is larger than the profiled value -561981. "
             "Use the profiled value instead."],
            1, "startup", None, "oom_at_init", "lower --context-length", id="negative-kv-budget",
        ),
        pytest.param(
            [*TRACEBACK, "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.02 GiB. GPU 0 has a total "
             "capacity of 23.53 GiB of which 512.00 MiB is free."],
            1, "runtime", None, "cuda_oom", "lower --mem-fraction-static", id="cuda-oom-while-serving",
        ),
        pytest.param(
            ["torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB."],
            1, "startup", None, "cuda_oom", "--cuda-graph-max-bs", id="cuda-oom-while-capturing-graphs",
        ),
        pytest.param(
            [*TRACEBACK, "RuntimeError: CUDART error: peer access is not supported between these two devices"],
            1, "startup", None, "no_p2p", "--disable-custom-all-reduce", id="no-p2p",
        ),
        pytest.param(
            ["RuntimeError: CUDA error: no kernel image is available for execution on the device"],
            1, "startup", None, "no_kernel_image", "CUDA 12.8", id="no-kernel-image",
        ),
        pytest.param(
            ["UserWarning: NVIDIA GeForce RTX 5090 with CUDA capability sm_120 is not compatible with the current "
             "PyTorch installation."],
            1, "startup", None, "no_kernel_image", "sm_120", id="torch-without-sm120",
        ),
        pytest.param(
            ["ValueError: The output_size of gate's and up's weight = 192 is not divisible by weight quantization "
             "block_n = 128."],
            1, "startup", None, "fp8_block_divisibility", "--tp-size", id="fp8-block-n",
        ),
        pytest.param(
            ["ERROR:    [Errno 98] error while attempting to bind on address ('127.0.0.1', 8000): address already in use"],
            1, "startup", None, "port_in_use", "another port", id="port-in-use",
        ),
        pytest.param(
            ["The server is not configured to return the hidden states. Please set `--enable-return-hidden-states` "
             "to enable this feature."],
            1, "runtime", None, "hidden_states_flag", "--enable-return-hidden-states", id="hidden-states-flag",
        ),
        pytest.param(
            ["OSError: /data/models/Qwen3.6 is not a local folder and is not a valid model identifier listed on "
             "'https://huggingface.co/models'"],
            1, "startup", None, "model_not_found", "--model-path", id="model-path-not-found",
        ),
        pytest.param(
            ["engy-node: model: --checkpoint /nope: no config.json there; point it at a model directory"],
            2, "startup", None, "model_not_found", "--checkpoint", id="reference-checkpoint-not-found",
        ),
        pytest.param(
            ["ERROR:    [Errno 98] address already in use", "torch.OutOfMemoryError: CUDA out of memory."],
            1, "startup", None, "port_in_use", "ss -ltnp", id="root-cause-wins-over-later-errors",
        ),
        pytest.param(
            ["torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 64.00 MiB."],
            None, "runtime", "stalled", "cuda_oom", "--max-running-requests", id="log-evidence-wins-over-a-stall",
        ),
        pytest.param(
            ["Loading safetensors checkpoint shards:  40% Completed | 2/5 [00:41<01:02, 20.8s/it]"],
            None, "startup", "startup_timeout", "startup_timeout", "startup_timeout_s", id="startup-timeout",
        ),
        pytest.param(
            ["[2025-05-01 11:00:00 TP0] Decode batch. #running-req: 8, #token: 90112, token usage: 0.41"],
            None, "runtime", "stalled", "stalled", "--max-running-requests", id="stalled",
        ),
        pytest.param([], None, "runtime", "unhealthy", "unhealthy", "log tail", id="unhealthy"),
    ],
)
def test_a_failure_is_classified_from_its_log_and_names_the_fix(tail, exit_code, phase, detected, kind, fix_says):
    failure = classify_failure(log_tail=tail, exit_code=exit_code, phase=phase, detected=detected)
    assert failure.kind == kind
    assert fix_says in failure.fix
    assert failure.summary


def test_the_two_memory_errors_get_opposite_fixes():
    at_init = classify_failure(log_tail=["RuntimeError: Not enough memory. Please try to increase --mem-fraction-static."],
                               exit_code=1, phase="startup")
    serving = classify_failure(log_tail=["torch.OutOfMemoryError: CUDA out of memory."], exit_code=1, phase="runtime")
    assert at_init.fix.startswith("increase --mem-fraction-static")
    assert serving.fix.startswith("lower --mem-fraction-static")


def test_an_unknown_failure_quotes_the_last_exception_line_not_the_noise_after_it():
    tail = [*TRACEBACK, "ValueError: rope_scaling must have a 'type' field",
            "[2025-05-01 10:00:09] Received sigquit from a child process. It usually means the child failed."]
    failure = classify_failure(log_tail=tail, exit_code=1, phase="startup")
    assert failure.kind == "unknown"
    assert failure.summary == "exited with code 1: ValueError: rope_scaling must have a 'type' field"


def test_a_silent_sigkill_points_at_the_kernel_oom_killer():
    failure = classify_failure(log_tail=[], exit_code=-signal.SIGKILL, phase="runtime")
    assert failure.kind == "unknown"
    assert failure.summary == "was killed by SIGKILL; it printed nothing"
    assert "dmesg" in failure.fix


def test_a_huge_log_line_is_shortened_in_the_summary():
    failure = classify_failure(log_tail=["RuntimeError: " + "x" * 5000], exit_code=1, phase="startup")
    assert len(failure.summary) < 400


# ---- stall detection -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("running", "tokens", "last", "since", "stalled"),
    [
        (2, 100.0, 100.0, 181.0, True),
        (2, 100.0, 100.0, 180.0, True),
        (2, 100.0, 100.0, 179.9, False),
        (0, 100.0, 100.0, 3600.0, False),  # idle is not stalled
        (2, 101.0, 100.0, 3600.0, False),  # tokens moved
        (2, 5.0, 100.0, 3600.0, False),  # counter went back: the server restarted
    ],
)
def test_a_stall_is_requests_running_with_a_flat_token_counter_for_long_enough(running, tokens, last, since, stalled):
    assert detect_stall(running=running, generation_tokens_total=tokens, last_progress_tokens=last,
                        seconds_since_progress=since, stall_after_s=180.0) is stalled


# ---- output lines --------------------------------------------------------------------------------


def test_output_is_split_into_lines_across_reads_at_newlines_and_carriage_returns():
    buffer = LineBuffer(max_line_bytes=100)
    assert buffer.feed(b"first li") == []
    assert buffer.feed(b"ne\nLoading 10%\rLoading 20%\r\n\nlast") == ["first line", "Loading 10%", "Loading 20%"]
    assert buffer.flush() == ["last"]
    assert buffer.truncated == 0


def test_an_overlong_line_is_cut_marked_and_counted_and_the_rest_is_not_kept():
    buffer = LineBuffer(max_line_bytes=10)
    assert buffer.feed(b"0123456789abc") == ["0123456789" + TRUNCATION_MARK]
    assert buffer.feed(b"def" * 1000) == []
    assert buffer.feed(b"ghi\nshort\n" + b"y" * 11 + b"\n") == ["short", "yyyyyyyyyy" + TRUNCATION_MARK]
    assert buffer.truncated == 2
    assert len(buffer._partial) == 0


def test_bytes_that_are_not_utf8_are_replaced_not_fatal():
    assert LineBuffer(max_line_bytes=100).feed(b"bad \xff byte\n") == ["bad \ufffd byte"]


@pytest.mark.parametrize(("field", "value"), [("probe_interval_s", 0), ("stop_grace_s", -1.0),
                                              ("max_startup_failures", 1.5), ("log_tail_lines", True)])
def test_settings_refuse_nonsense_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SupervisorSettings(**{field: value})


# ---- the supervisor, with real children ----------------------------------------------------------

# A stand-in model server for the cases the reference server cannot act out on cue.
# argv: port, mode, marker file (exists after the first start, so "-once" modes misbehave once).
CHILD_SCRIPT = textwrap.dedent(
    '''
    import http.server, os, signal, subprocess, sys, threading, time

    port, mode, marker = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    first = not os.path.exists(marker)
    open(marker, "a").close()
    LIFETIME_S = 60  # a child a failing test forgets still goes away on its own
    healthy_answered = threading.Event()

    if mode == "oom-at-init":
        print("[2025-05-01 10:00:00 TP0] Load weight end. type=Qwen3MoeForCausalLM, avail mem=0.41 GB, mem usage=21.73 GB.")
        print("RuntimeError: Not enough memory. Please try to increase --mem-fraction-static.")
        sys.exit(1)

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            if self.path == "/health":
                self.answer(503 if mode == "never-ready" else 200, b"")
                healthy_answered.set()
            elif self.path == "/metrics" and mode == "stall-once":
                running = 1 if first else 0
                self.answer(200, f"sglang:num_running_reqs {running}\\nsglang:generation_tokens_total 42\\n".encode())
            else:
                self.answer(404, b"")

        def answer(self, status, body):
            self.send_response(status)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    print(f"child pid {os.getpid()}", flush=True)
    if mode == "stubborn":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        print(f"grandchild pid {grandchild.pid}", flush=True)
    if mode == "crash-once" and first:
        healthy_answered.wait(10)
        time.sleep(0.2)
        print("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.02 GiB. GPU 0 has a total capacity of "
              "23.53 GiB of which 512.00 MiB is free.", flush=True)
        sys.exit(1)
    time.sleep(LIFETIME_S)
    '''
)

# Fast everything, so each scripted case takes about a second.
FAST = SupervisorSettings(
    startup_timeout_s=10, startup_poll_interval_s=0.05, probe_interval_s=0.05, probe_timeout_s=2,
    stall_after_s=0.3, max_startup_failures=3, restart_base_s=0.01, restart_cap_s=0.02, stop_grace_s=5,
)
TEST_DEADLINE_S = 30


def free_port() -> int:
    """A port nothing listens on right now (the supervisor must know it before the child starts)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def scripted_spec(tmp_path: Path, mode: str) -> LaunchSpec:
    script = tmp_path / "child.py"
    script.write_text(CHILD_SCRIPT)
    port = free_port()
    argv = (sys.executable, str(script), str(port), mode, str(tmp_path / "started-once"))
    return LaunchSpec(kind="reference", argv=argv, env=(), base_url=f"http://127.0.0.1:{port}")


def is_running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def model_server(hub: Hub) -> dict:
    return hub.states()["model_server"]


async def wait_until(condition: Callable[[], bool], *, timeout_s: float, what: str) -> None:
    with trio.move_on_after(timeout_s):
        while not condition():
            await trio.sleep(0.02)
        return
    raise AssertionError(f"not {what} within {timeout_s} s")


async def test_the_reference_server_is_supervised_from_start_to_ready_to_restart_to_stop(checkpoint, tmp_path):
    spec = reference_launch(python=sys.executable, home=tmp_path / "home", model="smollm2-135m", checkpoint=checkpoint,
                            port=free_port(), dtype="bfloat16", device="cpu", max_running_requests=2)
    settings = SupervisorSettings(startup_timeout_s=120, startup_poll_interval_s=0.1, probe_interval_s=0.2,
                                  probe_timeout_s=5, restart_base_s=0.05, restart_cap_s=0.1, stop_grace_s=10)
    hub = Hub()
    supervisor = ModelServerSupervisor(spec, hub, settings=settings)
    # What install_logging does for a node: every engy.* record goes into the hub's ring.
    ring = HubHandler(hub)
    child_log = logging.getLogger("engy.model_server")
    level = child_log.level
    child_log.addHandler(ring)
    child_log.setLevel(logging.DEBUG)
    try:
        with trio.fail_after(90):
            async with trio.open_nursery() as nursery:
                url = await nursery.start(supervisor.run)
                assert url == spec.base_url
                state = model_server(hub)
                assert (state["state"], state["restarts"], state["kind"]) == ("ready", 0, "reference")
                assert state["command"] == shell_command(spec)
                first_pid = state["pid"]

                async with httpx.AsyncClient(base_url=url, trust_env=False, timeout=60) as client:
                    response = await client.post("/generate", json={
                        "input_ids": [1, 504, 3575], "sampling_params": {"temperature": 0, "max_new_tokens": 4}})
                    assert response.status_code == 200
                await wait_until(lambda: (model_server(hub).get("generation_tokens_total") or 0) >= 4
                                 and model_server(hub).get("ttft_p50_ms") is not None, timeout_s=10, what="scraped")
                state = model_server(hub)
                assert state["itl_p50_ms"] is not None and state["running"] == 0 and state["queued"] == 0

                # The child's own log reached the hub's ring through the engy.model_server logger.
                events = hub.events_since(0, limit=10_000).events
                assert any(e.component == "model_server" and "ready to roll" in e.message for e in events)

                os.killpg(first_pid, signal.SIGKILL)
                await wait_until(lambda: model_server(hub)["restarts"] == 1 and model_server(hub)["state"] == "ready",
                                 timeout_s=60, what="restarted and ready again")
                state = model_server(hub)
                second_pid = state["pid"]
                assert second_pid != first_pid
                assert state["last_failure"]["kind"] == "unknown"
                assert state["last_failure"]["summary"].startswith("was killed by SIGKILL")
                assert state["last_failure"]["phase"] == "runtime"
                nursery.cancel_scope.cancel()
    finally:
        child_log.removeHandler(ring)
        child_log.setLevel(level)
    assert model_server(hub)["state"] == "stopped"
    assert not is_running(first_pid) and not is_running(second_pid)


async def test_a_child_that_crashes_after_becoming_ready_is_restarted_with_the_failure_recorded(tmp_path):
    hub = Hub()
    supervisor = ModelServerSupervisor(scripted_spec(tmp_path, "crash-once"), hub, settings=FAST, jitter=lambda: 0.0)
    with trio.fail_after(TEST_DEADLINE_S):
        async with trio.open_nursery() as nursery:
            await nursery.start(supervisor.run)
            first_pid = model_server(hub)["pid"]
            await wait_until(lambda: model_server(hub)["restarts"] == 1 and model_server(hub)["state"] == "ready",
                             timeout_s=10, what="restarted and ready again")
            state = model_server(hub)
            assert state["last_failure"]["kind"] == "cuda_oom"
            assert state["last_failure"]["phase"] == "runtime"
            assert state["last_failure"]["exit_code"] == 1
            assert "lower --mem-fraction-static" in state["last_failure"]["fix"]
            assert supervisor.last_failure is not None and supervisor.last_failure.kind == "cuda_oom"
            second_pid = state["pid"]
            assert second_pid != first_pid
            nursery.cancel_scope.cancel()
    assert not is_running(second_pid)


async def test_a_server_that_never_starts_makes_run_raise_with_the_classified_failure_and_its_fix(tmp_path):
    hub = Hub()
    supervisor = ModelServerSupervisor(scripted_spec(tmp_path, "oom-at-init"), hub, settings=FAST)
    with trio.fail_after(TEST_DEADLINE_S), pytest.raises(ModelServerError) as raised:
        await supervisor.run()
    error = raised.value
    assert error.attempts == FAST.max_startup_failures
    assert error.failure.kind == "oom_at_init"
    assert "increase --mem-fraction-static" in error.failure.fix
    assert "increase --mem-fraction-static" in str(error) and "failed to start 3 times" in str(error)
    state = model_server(hub)
    assert (state["state"], state["restarts"], state["startup_failures"]) == ("failed", 2, 3)
    assert state["last_failure"]["kind"] == "oom_at_init"


async def test_a_failure_before_the_first_readiness_comes_out_of_nursery_start(tmp_path):
    supervisor = ModelServerSupervisor(scripted_spec(tmp_path, "oom-at-init"), Hub(), settings=FAST)
    with trio.fail_after(TEST_DEADLINE_S):
        async with trio.open_nursery() as nursery:
            with pytest.raises(ModelServerError):
                await nursery.start(supervisor.run)


async def test_a_child_that_never_turns_healthy_is_stopped_at_the_startup_deadline(tmp_path):
    settings = SupervisorSettings(startup_timeout_s=0.5, startup_poll_interval_s=0.05, probe_timeout_s=1,
                                  max_startup_failures=1, stop_grace_s=5)
    supervisor = ModelServerSupervisor(scripted_spec(tmp_path, "never-ready"), Hub(), settings=settings)
    with trio.fail_after(TEST_DEADLINE_S), pytest.raises(ModelServerError) as raised:
        await supervisor.run()
    assert raised.value.failure.kind == "startup_timeout"
    assert "startup_timeout_s" in raised.value.failure.fix
    pid = int(next(line for line in supervisor.log_tail if line.startswith("child pid")).split()[-1])
    assert not is_running(pid)


async def test_a_server_running_requests_without_producing_tokens_is_restarted_as_stalled(tmp_path):
    hub = Hub()
    supervisor = ModelServerSupervisor(scripted_spec(tmp_path, "stall-once"), hub, settings=FAST)
    with trio.fail_after(TEST_DEADLINE_S):
        async with trio.open_nursery() as nursery:
            await nursery.start(supervisor.run)
            await wait_until(lambda: model_server(hub)["restarts"] == 1 and model_server(hub)["state"] == "ready",
                             timeout_s=10, what="restarted after the stall")
            assert model_server(hub)["last_failure"]["kind"] == "stalled"
            pid = model_server(hub)["pid"]
            nursery.cancel_scope.cancel()
    assert not is_running(pid)


async def test_an_operator_restart_replaces_the_child_without_counting_a_failure(tmp_path):
    hub = Hub()
    supervisor = ModelServerSupervisor(scripted_spec(tmp_path, "serve"), hub, settings=FAST)
    with trio.fail_after(TEST_DEADLINE_S):
        async with trio.open_nursery() as nursery:
            await nursery.start(supervisor.run)
            first_pid = model_server(hub)["pid"]
            await supervisor.restart()
            assert not is_running(first_pid)
            await wait_until(lambda: model_server(hub)["state"] == "ready", timeout_s=10, what="ready again")
            state = model_server(hub)
            assert (state["restarts"], state["last_failure"]) == (1, None)
            assert state["pid"] != first_pid
            second_pid = state["pid"]
            nursery.cancel_scope.cancel()
    assert not is_running(second_pid)


async def test_restart_refuses_when_the_supervisor_is_not_running(tmp_path):
    supervisor = ModelServerSupervisor(scripted_spec(tmp_path, "serve"), Hub(), settings=FAST)
    with pytest.raises(RuntimeError, match="not running"):
        await supervisor.restart()


async def test_cancelling_kills_a_child_that_ignores_sigterm_and_everything_it_forked(tmp_path):
    settings = SupervisorSettings(startup_poll_interval_s=0.05, probe_interval_s=0.05, stop_grace_s=0.5)
    hub = Hub()
    supervisor = ModelServerSupervisor(scripted_spec(tmp_path, "stubborn"), hub, settings=settings)
    with trio.fail_after(TEST_DEADLINE_S):
        async with trio.open_nursery() as nursery:
            await nursery.start(supervisor.run)
            await wait_until(lambda: any(line.startswith("grandchild pid") for line in supervisor.log_tail),
                             timeout_s=10, what="forked")
            child_pid = model_server(hub)["pid"]
            grandchild_pid = int(next(line for line in supervisor.log_tail if line.startswith("grandchild pid")).split()[-1])
            assert is_running(grandchild_pid)
            nursery.cancel_scope.cancel()
    assert not is_running(child_pid)
    await wait_until(lambda: not is_running(grandchild_pid), timeout_s=5, what="grandchild gone")


async def test_a_command_that_cannot_be_executed_counts_as_a_failed_start(tmp_path):
    spec = LaunchSpec(kind="sglang", argv=(str(tmp_path / "no-such-python"), "-m", "sglang.launch_server"), env=(),
                      base_url=f"http://127.0.0.1:{free_port()}")
    supervisor = ModelServerSupervisor(spec, Hub(), settings=FAST)
    with trio.fail_after(TEST_DEADLINE_S), pytest.raises(ModelServerError) as raised:
        await supervisor.run()
    assert raised.value.failure.kind == "launch_failed"
    assert "no-such-python" in raised.value.failure.summary


async def test_a_port_that_already_answers_fails_the_start_without_spawning_a_child(tmp_path):
    spec = scripted_spec(tmp_path, "serve")
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", int(spec.base_url.rsplit(":", 1)[1])))
        squatter.listen()
        supervisor = ModelServerSupervisor(spec, Hub(), settings=SupervisorSettings(max_startup_failures=1))
        with trio.fail_after(TEST_DEADLINE_S), pytest.raises(ModelServerError) as raised:
            await supervisor.run()
    assert raised.value.failure.kind == "port_in_use"
    assert supervisor.log_tail == ()
    assert not (tmp_path / "started-once").exists()
