"""The reference server's capture on a small random Llama (engy_node.serve.capture): the record it
builds from references copied once per forward call, hashed on its own thread, has the root of
one built from each projection's own forward hook cloning its tensors at once; its wrappers stay
between its forward calls, recording nothing in a call without it, and leave the model as it was
with the capture, a failed call, another capture or `release`; a dropped capture ends its hashing
thread."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from engy_node.gemm.activations import GEMMS, RESIDUAL_OUT, RecordBuilder, llama_layout
from engy_node.serve.capture import ActivationCapture, CaptureError, SharedOpenings, release
from engy_node.serve.engine import ModelRunner

CALLS = ([5, 9, 2, 7, 1], [3], [8], [4, 6])
"""A prefill of five positions, two decode steps and a chunk of two."""


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=32,
    )
    return LlamaForCausalLM(config).to(torch.bfloat16).eval()


def capture_of(model) -> ActivationCapture:
    layout = llama_layout(model.config.to_dict(), "bfloat16")
    return ActivationCapture(layout, SharedOpenings(), weights_root="", arithmetic="bfloat16")


def hooked_rows(model, layout, seen: dict) -> torch.Tensor:
    """The rows as module hooks that clone every tensor when it is made would commit them."""
    return torch.cat([seen[slot] for slot in layout.columns()], dim=-1).reshape(-1, layout.row_bytes // 2)


def cloning_hooks(model, seen: dict) -> list:
    handles = []
    layers = model.model.layers
    for index, layer in enumerate(layers):

        def before(module, args, index=index):
            seen[index, "residual_in"] = args[0].clone()

        def after(module, args, output, index=index):
            if index == len(layers) - 1:
                seen[index, RESIDUAL_OUT] = output.clone()

        handles += [layer.register_forward_pre_hook(before), layer.register_forward_hook(after)]
        for name, (x_group, y_group) in GEMMS.items():
            module = getattr(layer.self_attn if name[0] in "qkvo" else layer.mlp, name)

            def projection(module, args, output, index=index, x_group=x_group, y_group=y_group):
                seen.setdefault((index, x_group), args[0].clone())
                seen[index, y_group] = output.clone()

            handles.append(module.register_forward_hook(projection))
    return handles


def test_the_record_is_what_each_projection_consumed_and_produced(model):
    capture = capture_of(model)
    layout = capture.layout
    reference = RecordBuilder(layout)
    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        for ids in CALLS:
            seen: dict = {}
            handles = cloning_hooks(model, seen)
            try:
                with capture.recording(model):
                    model.model(input_ids=torch.tensor([ids]), cache=cache, use_cache=True)
            finally:
                for handle in handles:
                    handle.remove()
            rows = hooked_rows(model, layout, seen).view(torch.int16)
            reference.add_rows(rows.shape[0], rows.numpy().tobytes())
    wire = capture.commit("r")
    assert wire["positions"] == sum(len(ids) for ids in CALLS)
    assert wire["activations_root"] == reference.finish().tree.root.hex()


def wrapped(model, kept) -> list:
    return [m for m in model.modules() if m is not kept and "forward" in m.__dict__]


def test_the_wrappers_stay_between_calls_and_leave_with_the_capture_or_a_failed_call(model):
    kept = model.model.layers[1].mlp.up_proj
    own = kept.forward
    kept.__dict__["forward"] = own  # an instance forward of someone else's is put back as it was
    try:
        with torch.inference_mode():
            capture = capture_of(model)
            with capture.recording(model):
                model.model(input_ids=torch.tensor([[1, 2]]), use_cache=False)
            assert len(wrapped(model, kept)) == 3 * 7 + 2  # layers and projections, up_proj's is kept's
            untouched = model.model(input_ids=torch.tensor([[3]]), use_cache=False).last_hidden_state
            with capture.recording(model):
                model.model(input_ids=torch.tensor([[3]]), use_cache=False)
            capture.commit("r")
            assert kept.__dict__["forward"] is own
            assert not wrapped(model, kept)
            assert capture.builder.positions == 3  # the call between recorded nothing

            other = capture_of(model)
            with other.recording(model):
                model.model(input_ids=torch.tensor([[3]]), use_cache=False)
            release(model)  # what ModelRunner.forward does before a call without a capture
            assert not wrapped(model, kept)
            assert torch.equal(untouched, model.model(input_ids=torch.tensor([[3]]), use_cache=False).last_hidden_state)
            other.close()

            failing = capture_of(model)
            with pytest.raises(CaptureError, match="layer 1's input is not layer 0's output"):
                with failing.recording(model):
                    model.model.layers[1](torch.zeros(1, 1, 16, dtype=torch.bfloat16))
            assert kept.__dict__["forward"] is own
            assert not wrapped(model, kept)
            failing.close()
    finally:
        del kept.__dict__["forward"]


def test_a_second_capture_takes_the_wrappers_from_the_first(model):
    first, second = capture_of(model), capture_of(model)
    cache_of = {capture: DynamicCache(config=model.config) for capture in (first, second)}
    with torch.inference_mode():
        for ids in ([1, 2], [3], [4]):
            for capture in (first, second):
                with capture.recording(model):
                    model.model(input_ids=torch.tensor([ids]), cache=cache_of[capture], use_cache=True)
    assert first.commit("a")["activations_root"] == second.commit("b")["activations_root"]
    assert not [m for m in model.modules() if "forward" in m.__dict__]


def test_a_dropped_capture_ends_its_hashing_thread(model):
    capture = capture_of(model)
    with torch.inference_mode(), capture.recording(model):
        model.model(input_ids=torch.tensor([[1, 2, 3]]), use_cache=False)
    hashing = [t for t in threading.enumerate() if t.name.startswith("engy-gemm-hash")]
    assert hashing
    capture.close()
    for thread in hashing:
        thread.join(timeout=30)
        assert not thread.is_alive()


def test_the_engine_interleaving_a_request_without_capture_changes_neither(model):
    """ModelRunner.forward takes the wrappers off before a call without a capture: that request
    computes what it computes alone, and the captured one commits the root it commits alone."""
    runner = ModelRunner(model, None, checkpoint=Path("."), device="cpu", dtype="bfloat16")

    def served(interleaved: bool) -> tuple[str, list]:
        capture, plain = capture_of(model), []
        caches = [runner.new_cache(), runner.new_cache()]
        for ids in CALLS:
            runner.forward(ids, caches[0], capture)
            if interleaved:
                plain.append(runner.forward(ids[::-1], caches[1])[0])
                assert not [m for m in model.modules() if "forward" in m.__dict__]
        return capture.commit("r")["activations_root"], plain

    alone = served(False)[0]
    root, plain = served(True)
    cache = runner.new_cache()
    assert root == alone
    for ids, hidden in zip(CALLS, plain, strict=True):
        assert torch.equal(hidden, runner.forward(ids[::-1], cache)[0])
