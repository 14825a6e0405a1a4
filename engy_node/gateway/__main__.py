"""`python -m engy_node.gateway`: one gateway worker process, started by the first (`workers.py`).

It reads its seat and the resolved config as JSON on stdin (the config may hold secrets, which
a command line would show to every user of the machine), serves until SIGTERM, and writes
`ready` on stdout once it serves, the only thing it ever writes there.
"""

from __future__ import annotations

import functools
import json
import sys

import trio

from engy_node import node
from engy_node.config import config_from_document
from engy_node.errors import EngyError
from engy_node.gateway.role import serve_gateway
from engy_node.gateway.workers import Seat
from engy_node.hub import Hub, install_logging



async def _say_ready(*, task_status=trio.TASK_STATUS_IGNORED) -> None:
    print("ready", flush=True)
    task_status.started()


def main() -> int:
    document = json.loads(sys.stdin.buffer.read())
    seat = Seat(**document["seat"])
    try:
        config = config_from_document(document["config"])
        hub = Hub(ring_size=config.node.log_ring_size)
        install_logging(hub, level=config.node.log_level, log_dir=config.paths.log_dir, process=f"gateway-{seat.index}")
        return node.run([(f"gateway worker {seat.index}", functools.partial(serve_gateway, config, hub, seat=seat)),
                         ("ready signal", _say_ready)])
    except EngyError as error:
        print(f"engy-node gateway worker {seat.index}: {error.title}: {error}", file=sys.stderr)
        return error.exit_code


if __name__ == "__main__":
    sys.exit(main())
