"""Build the model server's command line, and keep that server running: sglang on a GPU box,
our reference server everywhere else (docs/architecture.md).

The pure decisions sit in their own modules, and the one module that does IO calls them, never
the reverse:

* `command`: `sglang_launch` and `reference_launch` build a frozen `LaunchSpec` from a plan;
  `shell_command` renders it for a user to copy.
* `failures`: `classify_failure` turns a log tail into a `Failure` that names the fix;
  `detect_stall` says when "requests running, no tokens" has lasted too long.
* `output_lines`: `LineBuffer` splits the child's output bytes into bounded lines.
* `supervisor`: the imperative shell, `ModelServerSupervisor`, which starts the child, copies
  its log, waits for `/health`, probes and scrapes it while up, and restarts it with backoff.
* `stopping`: how a child goes (SIGTERM to its process group, the grace, SIGKILL, shielded and
  bounded) and how a start stops what an earlier run left behind (`leftovers` records it).

The names the rest of the node uses are re-exported here.
"""

from engy_node.miner.sglang.command import LaunchSpec, reference_launch, sglang_launch, shell_command
from engy_node.miner.sglang.failures import Failure, FailureKind, classify_failure, detect_stall
from engy_node.miner.sglang.output_lines import LineBuffer
from engy_node.miner.sglang.supervisor import ModelServerError, ModelServerSupervisor, SupervisorSettings

__all__ = [
    "Failure",
    "FailureKind",
    "LaunchSpec",
    "LineBuffer",
    "ModelServerError",
    "ModelServerSupervisor",
    "SupervisorSettings",
    "classify_failure",
    "detect_stall",
    "reference_launch",
    "sglang_launch",
    "shell_command",
]
