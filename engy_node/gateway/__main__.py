"""`python -m engy_node.gateway`: one gateway worker process, started by the first (`workers.py`).

It reads its seat and the resolved config as JSON on stdin (the config may hold secrets, which
a command line would show to every user of the machine), serves until SIGTERM or until the
first process is gone, and writes `ready` on stdout once it serves, the only thing it ever
writes there.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import signal
import sys

import trio

from engy_node import node
from engy_node.config import config_from_document
from engy_node.errors import EngyError
from engy_node.gateway.fleet.workers import Seat
from engy_node.gateway.role import serve_gateway
from engy_node.hub import Hub, install_logging

PARENT_CHECK_S = 1.0
log = logging.getLogger("engy.gateway")


async def _say_ready(*, task_status=trio.TASK_STATUS_IGNORED) -> None:
    print("ready", flush=True)
    task_status.started()


async def _stop_with_parent(parent_pid: int, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Stop (as on SIGTERM) once the first process is gone, however it went (killed, out of
    memory): a worker left behind would keep the ports and take buyers with no supervisor.
    Polled: the kernel's parent-death signal follows the thread that started the process,
    and trio starts processes from a worker thread that may end long before the parent."""
    task_status.started()
    while os.getppid() == parent_pid:
        await trio.sleep(PARENT_CHECK_S)
    log.warning("the first gateway process (pid %d) is gone; stopping", parent_pid)
    os.kill(os.getpid(), signal.SIGTERM)


def main() -> int:
    parent_pid = os.getppid()
    document = json.loads(sys.stdin.buffer.read())
    seat = Seat(**document["seat"])
    try:
        config = config_from_document(document["config"])
        hub = Hub(ring_size=config.node.log_ring_size)
        install_logging(hub, level=config.node.log_level, log_dir=config.paths.log_dir, process=f"gateway-{seat.index}")
        # A second SIGTERM (a service manager signalling every process, then the first process
        # passing it on) must not cut the drain short; the first process decides when to kill.
        return node.run(
            [
                (f"gateway worker {seat.index}", functools.partial(serve_gateway, config, hub, seat=seat)),
                ("parent watch", functools.partial(_stop_with_parent, parent_pid)),
                ("ready signal", _say_ready),
            ],
            exit_on_second_signal=False,
        )
    except EngyError as error:
        print(f"engy-node gateway worker {seat.index}: {error.title}: {error}", file=sys.stderr)
        return error.exit_code


if __name__ == "__main__":
    sys.exit(main())
