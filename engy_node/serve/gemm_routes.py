"""`POST /gemm/openings`: the rows a GEMM-audit challenge picks from an answer's committed
activations, each with its Merkle path (`engy_node.gemm.activations`).

Body ``{"rid": "...", "picks": [{"position": p, "layer": l, "group": g}, …]}``; the answer is
``{"rid", "activations_root", "positions", "openings": [{position, layer, group, values, path}]}``
with ``values`` in the format `engy_node.serve.app.encode_array` writes (dtype, shape, base64 of
the little-endian bytes) and ``path`` the sibling hashes in hex, bottom up. A ``residual_out``
pick before the last layer comes back as the next layer's ``residual_in``, where it is
committed. A record past the challenge window (or one never made) is a 404 that says so; a pick
outside the answer is a 400 naming it.
"""

from __future__ import annotations

import orjson
import trio
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from engy_node.asgi import BodyError, read_json_object
from engy_node.gemm.activations import CommitmentError, parse_picks
from engy_node.serve.capture import MAX_PICKS, SharedOpenings

MAX_BODY_BYTES = 1024 * 1024
"""A challenge of MAX_PICKS picks is about 200 KB."""
BODY_TIMEOUT_S = 30.0


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message}}, status_code=status)


class GemmRoutes:
    def __init__(self, openings: SharedOpenings) -> None:
        self.openings = openings

    async def openings_route(self, request: Request) -> Response:
        try:
            body = await read_json_object(request.receive, max_bytes=MAX_BODY_BYTES, timeout_s=BODY_TIMEOUT_S)
        except BodyError as error:
            return _error(error.status, str(error))
        rid = body.get("rid")
        if not isinstance(rid, str) or not rid:
            return _error(400, "rid must be the request id of an answer that asked for return_gemm_commitment")
        try:
            picks = parse_picks(body.get("picks"), MAX_PICKS)
            opened = await trio.to_thread.run_sync(self.openings.open, rid, picks)
        except CommitmentError as error:
            return _error(400, str(error))
        if opened is None:
            return _error(
                404,
                f"no activation record for request {rid}: records are kept for {self.openings.window_s:.0f} s "
                f"after the answer (and while they fit in {self.openings.max_bytes} bytes), and only for "
                "requests that asked for return_gemm_commitment; challenge sooner",
            )
        record, openings = opened
        layout = record.layout
        payload = {
            "rid": rid,
            "activations_root": record.tree.root.hex(),
            "positions": record.positions,
            "openings": [o.to_wire(layout.dtype, layout.width(o.group)) for o in openings],
        }
        return Response(orjson.dumps(payload), media_type="application/json")
