"""Which tensors of a checkpoint form which committed matrix, layer, expert and the lm group.

A weight commitment is only useful if everyone groups a checkpoint's tensors the same way, so the
grouping is a pure function of the tensor names, dtypes and shapes (read from the safetensors
headers) and config.json, decided here and nowhere else:

* a decoder layer is every tensor named ``<prefix>layers.<i>.<rest>`` under the prefix with the
  most layers (``model.``); config.json's layer count must match, so a checkpoint missing a
  layer, or a layer missing a tensor its siblings have, is refused rather than committed short;
* within a layer, ``…experts.<j>.…`` tensors belong to routed expert ``j`` (MoE), the rest
  (attention, norms, router, shared expert) to the layer itself;
* everything else — embeddings, lm_head, the final norm, an MTP head or vision tower — is the lm
  group, so every tensor in the checkpoint is bound by the root (the public spec leaves norms and
  token mixers in a "trust region"; committing them costs nothing and the later replay of norms
  between audited GEMMs needs their weights pinned);
* a block-FP8 ``X.weight_scale_inv`` is not a matrix of its own: it joins ``X.weight``, whose
  rows it dequantizes one block of ``weight_block_size[0]`` rows at a time (config.json's
  ``quantization_config``), as the public SN53 spec binds ``weight`` + ``weight_scale_inv``.

Pure functions over plain data; `engy_node.gemm.checkpoint` reads the files.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections import Counter
from collections.abc import Mapping
from typing import Any

from engy_node.errors import ModelError

SCALE_SUFFIX = "_scale_inv"
"""``weight_scale_inv``: the per-block inverse scale of a block-FP8 ``weight``."""

_LAYER = re.compile(r"^(?P<prefix>(?:.*\.)?layers)\.(?P<index>\d+)\.(?P<rest>.+)$")
_EXPERT = re.compile(r"(?:^|\.)experts\.(?P<index>\d+)\.")


@dataclasses.dataclass(frozen=True, slots=True)
class TensorInfo:
    """A tensor as its safetensors header describes it."""

    name: str
    dtype: str
    """safetensors' name for the stored dtype ("BF16", "F8_E4M3", …), never a converted one."""
    shape: tuple[int, ...]

    @property
    def rows(self) -> int:
        """A row is the last dimension: an (out, in) weight has `out` rows, a norm vector one."""
        return math.prod(self.shape[:-1])


@dataclasses.dataclass(frozen=True, slots=True)
class Matrix:
    """One committed matrix: a tensor, and the block-FP8 scales that dequantize it if it has them."""

    weight: TensorInfo
    scale: TensorInfo | None = None
    block_rows: int = 0
    """Weight rows per scale row (0 without a scale): row i is dequantized by scale row i // block_rows."""

    @property
    def name(self) -> str:
        return self.weight.name


@dataclasses.dataclass(frozen=True, slots=True)
class LayerLayout:
    matrices: tuple[Matrix, ...]
    """The layer's own matrices in name order (attention, norms, router, shared expert)."""
    experts: tuple[tuple[Matrix, ...], ...] = ()
    """Routed expert j's matrices in name order, by expert index; empty for a dense layer."""


@dataclasses.dataclass(frozen=True, slots=True)
class Layout:
    config: dict[str, int | str]
    """The committed config (the public spec's keys), hashed into the root."""
    layers: tuple[LayerLayout, ...]
    lm: tuple[Matrix, ...]
    """Every tensor outside the decoder layers, in name order."""

    def matrices(self) -> list[Matrix]:
        """Every committed matrix: the lm group's, then each layer's own, then every expert's."""
        own = [m for layer in self.layers for m in layer.matrices]
        return [*self.lm, *own, *(m for layer in self.layers for expert in layer.experts for m in expert)]


def committed_config(config_json: Mapping[str, Any]) -> dict[str, int | str]:
    """The public spec's `config` from a checkpoint's config.json: arch, n_layers, hidden, d_ff,
    n_experts, top_k, vocab (d_ff is the expert width for a MoE model; 0 experts for dense)."""
    text = config_json.get("text_config") or config_json

    def field(*keys: str, default: int | None = None) -> int:
        for key in keys:
            if isinstance(text.get(key), int):
                return int(text[key])
        if default is None:
            raise ModelError(f"config.json has no integer {keys[0]!r}; commit a transformers checkpoint's config")
        return default

    n_experts = field("num_experts", "n_routed_experts", "num_local_experts", default=0)
    arch = text.get("model_type") or config_json.get("model_type")
    if not isinstance(arch, str):
        raise ModelError("config.json has no 'model_type'; commit a transformers checkpoint's config")
    return {
        "arch": arch,
        "n_layers": field("num_hidden_layers"),
        "hidden": field("hidden_size"),
        "d_ff": field("moe_intermediate_size", "intermediate_size") if n_experts else field("intermediate_size"),
        "n_experts": n_experts,
        "top_k": field("num_experts_per_tok", default=0) if n_experts else 0,
        "vocab": field("vocab_size"),
    }


def weight_block_rows(config_json: Mapping[str, Any]) -> int | None:
    """Rows per block-FP8 scale row, from ``quantization_config.weight_block_size``; None if unset."""
    for source in (config_json, config_json.get("text_config") or {}):
        block = (source.get("quantization_config") or {}).get("weight_block_size")
        if isinstance(block, list) and block and isinstance(block[0], int) and block[0] > 0:
            return int(block[0])
    return None


def pair_scales(tensors: Mapping[str, TensorInfo], block_rows: int | None) -> list[Matrix]:
    """Every tensor as a matrix, each ``weight_scale_inv`` joined to its ``weight``."""
    matrices = []
    for name, info in sorted(tensors.items()):
        if name.endswith(SCALE_SUFFIX):
            if name.removesuffix(SCALE_SUFFIX) not in tensors:
                raise ModelError(
                    f"{name} has no {name.removesuffix(SCALE_SUFFIX)} to scale; the checkpoint is incomplete"
                )
            continue
        scale = tensors.get(name + SCALE_SUFFIX)
        if scale is None:
            matrices.append(Matrix(info))
            continue
        if block_rows is None:
            raise ModelError(
                f"{name} has block-FP8 scales but config.json sets no quantization_config.weight_block_size; "
                "commit the checkpoint with its original config.json"
            )
        if len(info.shape) != 2 or len(scale.shape) != 2 or scale.shape[0] != -(-info.shape[0] // block_rows):
            raise ModelError(
                f"{scale.name} has shape {list(scale.shape)}, not one row per {block_rows} rows of "
                f"{name} {list(info.shape)}; the checkpoint's scales do not match its weights"
            )
        matrices.append(Matrix(info, scale, block_rows))
    return matrices


def plan_layout(
    tensors: Mapping[str, TensorInfo], config: dict[str, int | str], block_rows: int | None = None
) -> Layout:
    """Group a checkpoint's tensors into layers, experts and the lm group (see the module doc)."""
    matrices = pair_scales(tensors, block_rows)
    prefixes = Counter(match["prefix"] for m in matrices if (match := _LAYER.match(m.name)))
    decoder = max(prefixes, key=lambda p: (prefixes[p], p == "model.layers")) if prefixes else None
    own: dict[int, list[Matrix]] = {}
    routed: dict[int, dict[int, list[Matrix]]] = {}
    lm = []
    for matrix in matrices:
        match = _LAYER.match(matrix.name)
        if match is None or match["prefix"] != decoder:
            lm.append(matrix)
            continue
        layer = int(match["index"])
        own.setdefault(layer, [])
        expert = _EXPERT.search(match["rest"])
        if expert is None:
            own[layer].append(matrix)
        else:
            routed.setdefault(layer, {}).setdefault(int(expert["index"]), []).append(matrix)
    n_layers = int(config["n_layers"])
    if sorted(own) != list(range(n_layers)):
        missing = sorted(set(range(n_layers)) - set(own))
        raise ModelError(
            f"config.json says {n_layers} layers but the checkpoint has {len(own)}"
            + (f" (no tensors for layers {missing[:8]})" if missing else "")
            + "; commit a complete checkpoint (every shard present)"
        )
    for layer, experts in routed.items():
        if sorted(experts) != list(range(len(experts))):
            missing = sorted(set(range(max(experts) + 1)) - set(experts))
            raise ModelError(
                f"{decoder}.{layer} has no tensors for experts {missing[:8]}; "
                "commit a complete checkpoint (every shard present)"
            )
    layers = tuple(
        LayerLayout(tuple(own[i]), tuple(tuple(e) for _, e in sorted(routed.get(i, {}).items())))
        for i in range(n_layers)
    )
    _check_alike(layers, decoder or "", config)
    return Layout(config=config, layers=layers, lm=tuple(lm))


def _relative(name: str) -> str:
    """A tensor's name without its layer and expert numbers, to compare layers with each other."""
    return _EXPERT.sub(".experts.*.", _LAYER.sub(r"\g<prefix>.*.\g<rest>", name))


def _check_alike(layers: tuple[LayerLayout, ...], prefix: str, config: Mapping[str, int | str]) -> None:
    """Refuse a layer lacking a tensor its siblings of the same kind (dense or MoE) have, an expert
    lacking one the layer's other experts have, and a MoE layer with another expert count than
    config.json's."""
    kinds: dict[bool, set[str]] = {}
    for layer in layers:
        names = {_relative(m.name) for m in layer.matrices}
        kinds[bool(layer.experts)] = kinds.get(bool(layer.experts), set()) | names
    for index, layer in enumerate(layers):
        lacking = kinds[bool(layer.experts)] - {_relative(m.name) for m in layer.matrices}
        if lacking:
            raise ModelError(
                f"{prefix}.{index} has no {sorted(lacking)[0]} (with * = {index}) that other layers have; "
                "commit a complete checkpoint (every shard present)"
            )
        if not layer.experts:
            continue
        if len(layer.experts) != config["n_experts"]:
            raise ModelError(
                f"{prefix}.{index} has {len(layer.experts)} experts, config.json says {config['n_experts']}; "
                "commit a complete checkpoint (every shard present)"
            )
        expected = {_relative(m.name) for expert in layer.experts for m in expert}
        for j, expert in enumerate(layer.experts):
            if {_relative(m.name) for m in expert} != expected:
                raise ModelError(
                    f"{prefix}.{index} expert {j} lacks tensors its other experts have; "
                    "commit a complete checkpoint (every shard present)"
                )
