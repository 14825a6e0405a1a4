"""Why the model server failed, and whether a running one has stalled: pure judgements the
supervisor makes from what it observed.

Pure: no IO, no clock reads. The supervisor passes in the log tail, the exit code, the phase
and what it saw itself; for stalls, the token counter and the seconds since it last moved.

What it trusts: the log is authoritative for *why* the server failed; the supervisor's own
observation (exit, startup timeout, failed probes, stall) only for *that* it failed. So a
recognised log line wins over what the supervisor detected, and what it detected wins over a
generic exit. Every `Failure` names the fix (the flag or setting to change), because the
operator reads it in the log, the TUI and `engy-node diagnose` and has to act on it; a failure
no pattern recognises is "unknown" and quotes the last error line rather than guess.
"""

from __future__ import annotations

import dataclasses
import re
import signal
from collections.abc import Callable, Sequence
from typing import Literal

__all__ = ["Failure", "FailureKind", "classify_failure", "detect_stall"]

# ---- failure classification ----------------------------------------------------------------------

FailureKind = Literal[
    "launch_failed",
    "oom_at_init",
    "cuda_oom",
    "no_p2p",
    "no_kernel_image",
    "fp8_block_divisibility",
    "port_in_use",
    "hidden_states_flag",
    "model_not_found",
    "startup_timeout",
    "unhealthy",
    "stalled",
    "unknown",
]
Phase = Literal["startup", "runtime"]
Detected = Literal["startup_timeout", "unhealthy", "stalled"]


@dataclasses.dataclass(frozen=True, slots=True)
class Failure:
    """Why the model server stopped, in a user's words: what happened and what to change."""

    kind: FailureKind
    summary: str
    """What happened, ending with the log line that shows it."""
    fix: str
    """What to change, naming the flag or setting."""

    def as_dict(self) -> dict[str, str]:
        return {"kind": self.kind, "summary": self.summary, "fix": self.fix}


@dataclasses.dataclass(frozen=True, slots=True)
class _Pattern:
    kind: FailureKind
    regex: re.Pattern[str]
    summary: str
    fix: str | Callable[[Phase], str]


def _cuda_oom_fix(phase: Phase) -> str:
    if phase == "startup":
        return (
            "lower --mem-fraction-static a little (e.g. 0.83 -> 0.80) so CUDA graphs and activations "
            "have room, or lower --cuda-graph-max-bs; raising it is the fix for the opposite error, "
            "'Not enough memory' at init"
        )
    return (
        "lower --mem-fraction-static a little (e.g. 0.83 -> 0.80), --max-running-requests, or "
        "--chunked-prefill-size (e.g. 4096) for long prompts; raising it is the fix for the opposite "
        "error, 'Not enough memory' at init"
    )


# The supervisor writes this line into the tail when the command cannot even be executed.
LAUNCH_FAILED_PREFIX = "engy: cannot execute the model server command: "

# Checked in this order; the first kind with a matching line wins, because a root cause
# (a taken port, a missing kernel) often drags later, vaguer errors behind it in the same log.
# Each phrase is quoted from the error messages of sglang 0.5 (its server launch and scheduler),
# PyTorch, huggingface_hub or our reference server.
_PATTERNS: tuple[_Pattern, ...] = (
    _Pattern(
        "launch_failed",
        re.compile(re.escape(LAUNCH_FAILED_PREFIX)),
        "the command could not be executed",
        "check that the command's first word exists and is executable: the python of the environment "
        "sglang (or engy-node) is installed in",
    ),
    _Pattern(
        "port_in_use",
        re.compile(r"address already in use", re.IGNORECASE),
        "the port is taken by another process",
        "another process, perhaps a model server left over from a node that was killed, holds the port: "
        "find it with `ss -ltnp` and stop it, or give the model server another port",
    ),
    _Pattern(
        "model_not_found",
        re.compile(
            r"is not a local folder and is not a valid model identifier|Repo id must be in the form"
            r"|does not appear to have a file named config\.json|no config\.json there"
        ),
        "the model path does not lead to a checkpoint",
        "point --model-path (--checkpoint for the reference server) at the downloaded checkpoint directory, "
        "the one holding config.json and the *.safetensors shards",
    ),
    _Pattern(
        "no_kernel_image",
        re.compile(
            r"no kernel image is available for execution on the device"
            r"|sm_\d+ is not compatible with the current PyTorch installation"
        ),
        "the installed CUDA build has no kernels for this GPU",
        "install a PyTorch/sglang build for CUDA 12.8 or newer (RTX 5090 is sm_120), and pick an attention "
        "backend that supports the GPU (e.g. --attention-backend triton)",
    ),
    _Pattern(
        "no_p2p",
        re.compile(r"peer access is not supported between these two devices"),
        "the GPUs cannot access each other's memory (no P2P, usual for GeForce cards)",
        "add --disable-custom-all-reduce (or --enable-p2p-check) so tensor parallelism uses NCCL all-reduce",
    ),
    _Pattern(
        "fp8_block_divisibility",
        re.compile(r"is not divisible by weight quantization block_n"),
        "the FP8 block-quantized weights cannot be split evenly across the GPUs at this tensor-parallel size",
        "choose another tp (--tp-size) such that moe_intermediate_size / tp is a multiple of 128, "
        "and use the remaining GPUs for data parallelism (--dp-size)",
    ),
    _Pattern(
        "oom_at_init",
        re.compile(
            r"Not enough memory\. Please try to increase --mem-fraction-static"
            r"|is larger than the profiled value -\d"
        ),
        "out of memory at start: after loading the weights no room is left for the KV cache",
        "increase --mem-fraction-static (e.g. 0.83 -> 0.85) or lower --context-length; lowering it is "
        "the fix for the opposite error, CUDA out of memory while serving",
    ),
    _Pattern(
        "cuda_oom",
        re.compile(r"CUDA out of memory|CUDA error: out of memory"),
        "CUDA ran out of memory",
        _cuda_oom_fix,
    ),
    _Pattern(
        "hidden_states_flag",
        re.compile(r"not configured to return (the )?hidden states"),
        "the server refuses to return hidden states, which every proof needs",
        "start it with --enable-return-hidden-states",
    ),
)

_EXCEPTION_LINE = re.compile(r"^\s*(?:[\w.]+\.)?\w*(?:Error|Exception)\b")
_ERRORISH_LINE = re.compile(r"error|exception|fatal|failed|traceback", re.IGNORECASE)

# Log lines quoted into a summary are cut here: a summary is one line on a dashboard.
SUMMARY_LINE_CHARS = 300


def _quote(line: str) -> str:
    line = line.strip()
    return line if len(line) <= SUMMARY_LINE_CHARS else line[: SUMMARY_LINE_CHARS - 1] + "…"


def _exit_text(exit_code: int | None) -> str:
    if exit_code is None:
        return "was stopped by the supervisor"
    if exit_code < 0:
        try:
            return f"was killed by {signal.Signals(-exit_code).name}"
        except ValueError:
            return f"was killed by signal {-exit_code}"
    return f"exited with code {exit_code}"


def _last_error_line(log_tail: Sequence[str]) -> str | None:
    """The final exception line (`RuntimeError: …`) if any, else the last line that mentions an error."""
    for regex in (_EXCEPTION_LINE, _ERRORISH_LINE):
        for line in reversed(log_tail):
            if regex.search(line):
                return line
    return None


def classify_failure(
    *,
    log_tail: Sequence[str],
    exit_code: int | None,
    phase: Phase,
    detected: Detected | None = None,
) -> Failure:
    """Why the model server failed, from its last log lines.

    `exit_code` is the child's (negative: killed by that signal; None: still running when the
    supervisor stopped it). `phase` says whether it had become ready. `detected` is what the
    supervisor itself saw when it was the one to stop the child. A recognised log line wins
    over `detected`, because it says why; `detected` wins over a generic exit. Otherwise the
    kind is "unknown" and the summary quotes the last error line.
    """
    for pattern in _PATTERNS:
        line = next((line for line in reversed(log_tail) if pattern.regex.search(line)), None)
        if line is not None:
            fix = pattern.fix(phase) if callable(pattern.fix) else pattern.fix
            when = "while starting" if phase == "startup" else "while serving"
            return Failure(pattern.kind, f"{pattern.summary} ({when}): {_quote(line)}", fix)

    last_line = next((line for line in reversed(log_tail) if line.strip()), None)
    evidence = f"; last log line: {_quote(last_line)}" if last_line else "; it printed nothing"
    if detected == "startup_timeout":
        return Failure(
            "startup_timeout",
            f"not answering /health with 200 before the startup deadline{evidence}",
            "if the log shows it still loading weights or compiling kernels, raise startup_timeout_s; "
            "otherwise the log shows where it hangs",
        )
    if detected == "unhealthy":
        return Failure(
            "unhealthy",
            f"stopped answering its health check{evidence}",
            "read the log tail for the cause; if it recurs under load, lower --max-running-requests",
        )
    if detected == "stalled":
        return Failure(
            "stalled",
            f"requests were running but no token was generated for too long{evidence}",
            "it is restarted automatically; if it recurs, lower --max-running-requests or "
            "--chunked-prefill-size, or try --disable-cuda-graph",
        )
    error_line = _last_error_line(log_tail)
    summary = _exit_text(exit_code) + (f": {_quote(error_line)}" if error_line else evidence)
    if exit_code == -signal.SIGKILL:
        fix = (
            "if nobody killed it, the kernel's OOM killer may have (host RAM, not GPU memory): "
            "check `dmesg`; otherwise read the log tail"
        )
    else:
        fix = "read the log tail for the cause; run the command shown by hand to reproduce it"
    return Failure("unknown", summary, fix)


# ---- stall detection -----------------------------------------------------------------------------


def detect_stall(
    *,
    running: int,
    generation_tokens_total: float,
    last_progress_tokens: float,
    seconds_since_progress: float,
    stall_after_s: float,
) -> bool:
    """True when requests are running yet the generated-token counter has not moved for
    `stall_after_s` seconds: the server accepts work and produces nothing (sglang #1270).

    Any change of the counter is progress; a lower value means the server restarted and its
    counter began again. No running request is idleness, never a stall.
    """
    return running > 0 and generation_tokens_total == last_progress_tokens and seconds_since_progress >= stall_after_s
