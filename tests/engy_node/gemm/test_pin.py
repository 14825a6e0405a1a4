"""The catalog's weights_root for the embedded model is what the commitment computes on it."""

from __future__ import annotations

from engy_node.gemm.checkpoint import commit_checkpoint
from engy_node.models import SMOLLM2_135M, model_root


def test_the_embedded_models_pinned_weights_root_is_its_checkpoints(checkpoint):
    commitment = commit_checkpoint(checkpoint)
    assert commitment.weights_root.hex() == SMOLLM2_135M.weights_root
    assert commitment.layout.config == {
        "arch": "llama",
        "n_layers": 30,
        "hidden": 576,
        "d_ff": 1536,
        "n_experts": 0,
        "top_k": 0,
        "vocab": 49152,
    }
    # Tied embeddings: embed_tokens is the lm_head; every layer's nine tensors are committed.
    assert [m.name for m in commitment.layout.lm] == ["model.embed_tokens.weight", "model.norm.weight"]
    assert {len(layer.matrices) for layer in commitment.layout.layers} == {9}
    assert commitment.weights_root.hex() != model_root(checkpoint)
