"""Failure classification from a log tail (each kind names its fix) and stall detection from the
token counter.
"""

from __future__ import annotations

import signal

import pytest

from engy_node.miner.sglang.failures import classify_failure, detect_stall

TRACEBACK = [
    "Traceback (most recent call last):",
    '  File "/sglang/srt/managers/scheduler.py", line 2300, in run_scheduler_process',
]


@pytest.mark.parametrize(
    ("tail", "exit_code", "phase", "detected", "kind", "fix_says"),
    [
        pytest.param(
            [
                "[2025-05-01 10:00:00 TP0] Load weight end. type=Qwen3MoeForCausalLM, avail mem=0.41 GB, mem usage=21.73 GB.",
                *TRACEBACK,
                "RuntimeError: Not enough memory. Please try to increase --mem-fraction-static.",
            ],
            1,
            "startup",
            None,
            "oom_at_init",
            "increase --mem-fraction-static",
            id="oom-at-init",
        ),
        pytest.param(
            [
                "[2025-05-01 10:00:03 TP0] max_total_tokens=600000 is larger than the profiled value -561981. "
                "Use the profiled value instead."
            ],
            1,
            "startup",
            None,
            "oom_at_init",
            "lower --context-length",
            id="negative-kv-budget",
        ),
        pytest.param(
            [
                *TRACEBACK,
                "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.02 GiB. GPU 0 has a total "
                "capacity of 23.53 GiB of which 512.00 MiB is free.",
            ],
            1,
            "runtime",
            None,
            "cuda_oom",
            "lower --mem-fraction-static",
            id="cuda-oom-while-serving",
        ),
        pytest.param(
            ["torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB."],
            1,
            "startup",
            None,
            "cuda_oom",
            "--cuda-graph-max-bs",
            id="cuda-oom-while-capturing-graphs",
        ),
        pytest.param(
            [*TRACEBACK, "RuntimeError: CUDART error: peer access is not supported between these two devices"],
            1,
            "startup",
            None,
            "no_p2p",
            "--disable-custom-all-reduce",
            id="no-p2p",
        ),
        pytest.param(
            ["RuntimeError: CUDA error: no kernel image is available for execution on the device"],
            1,
            "startup",
            None,
            "no_kernel_image",
            "CUDA 12.8",
            id="no-kernel-image",
        ),
        pytest.param(
            [
                "UserWarning: NVIDIA GeForce RTX 5090 with CUDA capability sm_120 is not compatible with the current "
                "PyTorch installation."
            ],
            1,
            "startup",
            None,
            "no_kernel_image",
            "sm_120",
            id="torch-without-sm120",
        ),
        pytest.param(
            [
                "ValueError: The output_size of gate's and up's weight = 192 is not divisible by weight quantization "
                "block_n = 128."
            ],
            1,
            "startup",
            None,
            "fp8_block_divisibility",
            "--tp-size",
            id="fp8-block-n",
        ),
        pytest.param(
            [
                "ERROR:    [Errno 98] error while attempting to bind on address ('127.0.0.1', 8000): address already in use"
            ],
            1,
            "startup",
            None,
            "port_in_use",
            "another port",
            id="port-in-use",
        ),
        pytest.param(
            [
                "The server is not configured to return the hidden states. Please set `--enable-return-hidden-states` "
                "to enable this feature."
            ],
            1,
            "runtime",
            None,
            "hidden_states_flag",
            "--enable-return-hidden-states",
            id="hidden-states-flag",
        ),
        pytest.param(
            [
                "OSError: /data/models/Qwen3.6 is not a local folder and is not a valid model identifier listed on "
                "'https://huggingface.co/models'"
            ],
            1,
            "startup",
            None,
            "model_not_found",
            "--model-path",
            id="model-path-not-found",
        ),
        pytest.param(
            ["engy-node: model: --checkpoint /nope: no config.json there; point it at a model directory"],
            2,
            "startup",
            None,
            "model_not_found",
            "--checkpoint",
            id="reference-checkpoint-not-found",
        ),
        pytest.param(
            ["ERROR:    [Errno 98] address already in use", "torch.OutOfMemoryError: CUDA out of memory."],
            1,
            "startup",
            None,
            "port_in_use",
            "ss -ltnp",
            id="root-cause-wins-over-later-errors",
        ),
        pytest.param(
            ["torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 64.00 MiB."],
            None,
            "runtime",
            "stalled",
            "cuda_oom",
            "--max-running-requests",
            id="log-evidence-wins-over-a-stall",
        ),
        pytest.param(
            ["Loading safetensors checkpoint shards:  40% Completed | 2/5 [00:41<01:02, 20.8s/it]"],
            None,
            "startup",
            "startup_timeout",
            "startup_timeout",
            "startup_timeout_s",
            id="startup-timeout",
        ),
        pytest.param(
            ["[2025-05-01 11:00:00 TP0] Decode batch. #running-req: 8, #token: 90112, token usage: 0.41"],
            None,
            "runtime",
            "stalled",
            "stalled",
            "--max-running-requests",
            id="stalled",
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
    at_init = classify_failure(
        log_tail=["RuntimeError: Not enough memory. Please try to increase --mem-fraction-static."],
        exit_code=1,
        phase="startup",
    )
    serving = classify_failure(log_tail=["torch.OutOfMemoryError: CUDA out of memory."], exit_code=1, phase="runtime")
    assert at_init.fix.startswith("increase --mem-fraction-static")
    assert serving.fix.startswith("lower --mem-fraction-static")


def test_an_unknown_failure_quotes_the_last_exception_line_not_the_noise_after_it():
    tail = [
        *TRACEBACK,
        "ValueError: rope_scaling must have a 'type' field",
        "[2025-05-01 10:00:09] Received sigquit from a child process. It usually means the child failed.",
    ]
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
    assert (
        detect_stall(
            running=running,
            generation_tokens_total=tokens,
            last_progress_tokens=last,
            seconds_since_progress=since,
            stall_after_s=180.0,
        )
        is stalled
    )
