"""The weight-commitment spec file: a commitment's roots as JSON, in the public SN53 spec's shape.

The public ``specs/<model>/model_spec.json.gz`` files carry ``config``, ``model_root``,
``lm_root``, ``layer_roots`` and ``expert_roots_by_layer``; ours carry the same, with the top root
named ``weights_root`` (`engy_node.gemm.commitment` says why), a ``format`` naming the leaf
hashing, and the layout the roots were built over: every matrix's name, stored dtype, shape and
the root of its row tree, per layer, expert and lm group. A verifier needs those to open a row (a matrix's row count
fixes its tree's shape) without the checkpoint, and the reader re-derives every summary root from
them, so a spec file whose roots do not follow from its matrices is refused instead of trusted.

Pure conversions to and from plain dicts, and a thin read and write (gzip when the name ends in
``.gz``, as the public files are).
"""

from __future__ import annotations

import gzip
from pathlib import Path
from typing import Any

import orjson

from engy_node.errors import ModelError
from engy_node.gemm.commitment import FORMAT, WeightsCommitment, compose
from engy_node.gemm.layout import LayerLayout, Layout, Matrix, TensorInfo


def _matrix_json(matrix: Matrix, root: bytes) -> dict[str, Any]:
    entry: dict[str, Any] = {
        "name": matrix.name,
        "dtype": matrix.weight.dtype,
        "shape": list(matrix.weight.shape),
        "rows_root": root.hex(),
    }
    if matrix.scale is not None:
        scale = matrix.scale
        entry["scale"] = {"name": scale.name, "dtype": scale.dtype, "shape": list(scale.shape)}
        entry["block_rows"] = matrix.block_rows
    return entry


def spec_json(commitment: WeightsCommitment) -> dict[str, Any]:
    """The spec file's content for this commitment."""
    layout, roots = commitment.layout, commitment.rows_roots
    return {
        "format": FORMAT,
        "config": layout.config,
        "weights_root": commitment.weights_root.hex(),
        "lm_root": commitment.lm_root.hex(),
        "layer_roots": [root.hex() for root in commitment.layer_roots],
        "expert_roots_by_layer": {
            str(i): [root.hex() for root in experts] for i, experts in enumerate(commitment.expert_roots) if experts
        },
        "layers": [
            {
                "matrices": [_matrix_json(m, roots[m.name]) for m in layer.matrices],
                "experts": [[_matrix_json(m, roots[m.name]) for m in expert] for expert in layer.experts],
            }
            for layer in layout.layers
        ],
        "lm": [_matrix_json(m, roots[m.name]) for m in layout.lm],
    }


def _matrix_from(entry: dict[str, Any], roots: dict[str, bytes]) -> Matrix:
    weight = TensorInfo(entry["name"], entry["dtype"], tuple(entry["shape"]))
    roots[weight.name] = bytes.fromhex(entry["rows_root"])
    scale = entry.get("scale")
    if scale is None:
        return Matrix(weight)
    return Matrix(weight, TensorInfo(scale["name"], scale["dtype"], tuple(scale["shape"])), entry["block_rows"])


def commitment_from_json(spec: dict[str, Any]) -> WeightsCommitment:
    """The commitment a spec file describes, its summary roots re-derived from its matrices."""
    if spec.get("format") != FORMAT:
        found = spec.get("format") or ("the public SN53 format" if "model_root" in spec else "none")
        raise ModelError(
            f"the spec's format is {found}, not {FORMAT}; its roots cannot be checked here "
            "(regenerate it with `engy-node weights commit --checkpoint DIR`)"
        )
    try:
        roots: dict[str, bytes] = {}
        layers = tuple(
            LayerLayout(
                matrices=tuple(_matrix_from(e, roots) for e in layer["matrices"]),
                experts=tuple(tuple(_matrix_from(e, roots) for e in expert) for expert in layer["experts"]),
            )
            for layer in spec["layers"]
        )
        lm = tuple(_matrix_from(e, roots) for e in spec["lm"])
        commitment = compose(Layout(config=dict(spec["config"]), layers=layers, lm=lm), roots)
        stated = (spec["weights_root"], spec["lm_root"], spec["layer_roots"], spec["expert_roots_by_layer"])
    except (KeyError, TypeError, ValueError) as error:
        raise ModelError(
            f"the spec file is malformed ({error!r}); regenerate it with `engy-node weights commit`"
        ) from None
    derived = spec_json(commitment)
    if stated != (
        derived["weights_root"],
        derived["lm_root"],
        derived["layer_roots"],
        derived["expert_roots_by_layer"],
    ):
        raise ModelError(
            "the spec file's roots do not follow from its matrices; it was edited or corrupted "
            "(regenerate it with `engy-node weights commit`)"
        )
    return commitment


def write_spec(path: str | Path, commitment: WeightsCommitment) -> None:
    data = orjson.dumps(spec_json(commitment), option=orjson.OPT_INDENT_2) + b"\n"
    Path(path).write_bytes(gzip.compress(data, mtime=0) if str(path).endswith(".gz") else data)


def read_spec(path: str | Path) -> WeightsCommitment:
    data = Path(path).read_bytes()
    try:
        spec = orjson.loads(gzip.decompress(data) if str(path).endswith(".gz") else data)
    except (orjson.JSONDecodeError, gzip.BadGzipFile, EOFError) as error:
        raise ModelError(f"{path} is not a spec file ({error}); write one with `engy-node weights commit`") from None
    if not isinstance(spec, dict):
        raise ModelError(f"{path} is not a spec file; write one with `engy-node weights commit`")
    return commitment_from_json(spec)
