"""The planner: the published configs come out of the rules, each GPU set gets the plan (or the
plain refusal) the table says, and properties that must hold for any model and any GPUs."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engy_node.errors import ModelError
from engy_node.hardware.fake_nvml import FakeNvml
from engy_node.hardware.gpu import detect
from engy_node.hardware.gpu_features import GpuSpec
from engy_node.hardware.model_shape import (
    ModelShape,
    kv_bytes_per_token,
    legal_tp_sizes,
    linear_state_bytes_per_request,
    model_shape_from_config,
    read_model_shape,
    tp_problem,
)
from engy_node.hardware.plan import (
    ACTIVATION_RESERVE_BYTES,
    CHUNKED_PREFILL_SIZE,
    mem_fraction_static_for,
    plan,
)

FIXTURES = Path(__file__).parents[2] / "fixtures"
MIB = 1024 * 1024
GIB = 1024 * MIB

QWEN36_CONFIG = json.loads((FIXTURES / "qwen3.6-35b-a3b-fp8" / "config.json").read_text())
QWEN36 = model_shape_from_config(QWEN36_CONFIG)
QWEN36_WEIGHT_BYTES = 35_100_000_000
"""The "~35 GB" of the engy spec (see the fixture's SOURCE.md)."""

SMOLLM2 = model_shape_from_config(json.loads((FIXTURES / "smollm2-135m" / "config.json").read_text()))
SMOLLM2_WEIGHT_BYTES = 269_060_552
"""The converted bf16 model.safetensors (see the fixture's SOURCE.md)."""

CHUNK: tuple[str, ...] = ()
"""--chunked-prefill-size is a Plan field of its own, not an extra flag."""
NO_CUSTOM_ALL_REDUCE = ("--disable-custom-all-reduce",)
TRITON = ("--attention-backend", "triton")


def plan_on(spec: str, *, p2p_ok: bool = False, **targets):
    inventory = detect(nvml=FakeNvml.from_spec(spec, p2p_ok=p2p_ok))
    return plan(
        shape=QWEN36, weight_bytes=QWEN36_WEIGHT_BYTES, gpus=inventory.gpus, p2p=inventory.p2p_ok_matrix, **targets
    )


def test_the_qwen36_config_parses_as_a_hybrid_fp8_moe():
    assert QWEN36.architecture == "Qwen3_5MoeForConditionalGeneration"
    assert (QWEN36.hidden_size, QWEN36.num_layers) == (2048, 40)
    assert (QWEN36.full_attention_layers, QWEN36.linear_attention_layers) == (10, 30)
    assert (QWEN36.num_attention_heads, QWEN36.num_kv_heads, QWEN36.head_dim) == (16, 2, 256)
    assert (QWEN36.num_experts, QWEN36.num_experts_per_tok) == (256, 8)
    assert (QWEN36.moe_intermediate_size, QWEN36.shared_expert_intermediate_size) == (512, 512)
    assert (QWEN36.quant_method, QWEN36.quant_block) == ("fp8", (128, 128))
    assert QWEN36.max_position_embeddings == 262144
    assert (QWEN36.linear_num_key_heads, QWEN36.linear_num_value_heads) == (16, 32)


def test_the_smollm2_config_parses_as_a_dense_model():
    assert (SMOLLM2.num_attention_heads, SMOLLM2.num_kv_heads, SMOLLM2.head_dim) == (9, 3, 64)
    assert (SMOLLM2.full_attention_layers, SMOLLM2.linear_attention_layers) == (30, 0)
    assert SMOLLM2.quant_block is None and SMOLLM2.num_experts is None
    assert SMOLLM2.max_position_embeddings == 8192


def test_the_published_4x4090_config_comes_out_of_the_rules():
    result = plan_on("4xRTX4090")

    assert result.fits and result.server == "sglang" and result.device == "cuda"
    assert (result.tp, result.dp) == (4, 1)
    assert result.mem_fraction_static == 0.83
    assert result.max_running_requests == 8
    assert result.context_length == 262144
    assert result.kv_cache_dtype == "fp8_e4m3"
    assert result.extra_flags == CHUNK + NO_CUSTOM_ALL_REDUCE
    assert result.max_inflight == 8
    assert result.gpu_indices == (0, 1, 2, 3)
    assert result.summary == (
        "tp 4 × dp 1 on 4× NVIDIA GeForce RTX 4090: 8 requests of up to 262144 tokens per replica, 8 in flight"
    )


@pytest.mark.parametrize(
    ("spec", "tp", "dp", "fraction", "running", "flags"),
    [
        ("2xRTX4090", 2, 1, 0.83, 2, CHUNK + NO_CUSTOM_ALL_REDUCE),
        ("3xRTX4090", 2, 1, 0.83, 2, CHUNK + NO_CUSTOM_ALL_REDUCE),
        ("4xRTX4090", 4, 1, 0.83, 8, CHUNK + NO_CUSTOM_ALL_REDUCE),
        ("8xRTX4090", 4, 2, 0.83, 8, CHUNK + NO_CUSTOM_ALL_REDUCE),
        ("2xRTX5090", 2, 1, 0.87, 8, CHUNK + NO_CUSTOM_ALL_REDUCE + TRITON),
        ("4xRTX5090", 2, 2, 0.87, 8, CHUNK + NO_CUSTOM_ALL_REDUCE + TRITON),
        ("RTX4090,RTX5090", 2, 1, 0.83, 2, CHUNK + NO_CUSTOM_ALL_REDUCE + TRITON),
    ],
)
def test_qwen36_plans_for_each_gpu_set(spec, tp, dp, fraction, running, flags):
    result = plan_on(spec)

    assert result.fits, result.summary
    assert (result.tp, result.dp, result.mem_fraction_static, result.max_running_requests) == (
        tp,
        dp,
        fraction,
        running,
    )
    assert result.extra_flags == flags
    assert result.context_length == 262144 and result.kv_cache_dtype == "fp8_e4m3"
    assert result.max_inflight == running * dp
    assert result.memory is not None and result.memory.static_bytes <= result.memory.budget_bytes


@pytest.mark.parametrize(
    ("spec", "summary"),
    [
        (
            "1xRTX4090",
            "32.7 GiB of weights need at least 2 GPUs of 24.0 GiB (each holds 19.9 GiB of weights and KV cache "
            "at --mem-fraction-static 0.83); found 1",
        ),
        (
            "1xRTX5090",
            "32.7 GiB of weights need at least 2 GPUs of 31.8 GiB (each holds 27.7 GiB of weights and KV cache "
            "at --mem-fraction-static 0.87); found 1",
        ),
    ],
)
def test_one_card_does_not_fit_and_says_why(spec, summary):
    result = plan_on(spec)

    assert not result.fits
    assert result.summary == summary
    assert result.reasons["fit"] == summary
    assert (result.tp, result.dp, result.max_running_requests, result.max_inflight) == (0, 0, 0, 0)
    assert result.extra_flags == ()


def test_eight_4090s_run_two_tp4_replicas_because_tp8_breaks_the_fp8_block():
    result = plan_on("8xRTX4090")

    assert (result.tp, result.dp, result.max_inflight) == (4, 2, 16)
    assert result.gpu_indices == tuple(range(8))
    assert (
        "tp 8 is not allowed (moe_intermediate_size 512 / 8 = 64 is not a multiple of the FP8 block 128)"
        in result.reasons["tp"]
    )
    assert "tp 2 would need 26.6 GiB" in result.reasons["tp"]
    assert result.reasons["dp"] == "2: 8 GPUs / tp 4"


def test_two_4090s_keep_the_full_context_and_lower_concurrency():
    result = plan_on("2xRTX4090")

    assert (result.context_length, result.max_running_requests) == (262144, 2)
    assert result.reasons["max_running_requests"].startswith("2 (target 8): ")
    assert result.reasons["max_running_requests"].endswith("context is kept, concurrency gives")


def test_an_odd_gpu_stays_idle_and_the_plan_says_so():
    result = plan_on("3xRTX4090")

    assert result.gpu_indices == (0, 1)
    assert result.reasons["dp"] == "1: 3 GPUs / tp 2; GPU 2 stays idle (not enough for another tp group)"
    assert "tp 3 is not allowed (16 attention heads do not split 3 ways)" in result.reasons["tp"]


def test_mixed_gpus_are_planned_as_the_smallest_and_say_so():
    result = plan_on("RTX4090,RTX5090")

    assert result.reasons["gpus"] == (
        "mixed GPUs (1× NVIDIA GeForce RTX 4090 (24.0 GiB), 1× NVIDIA GeForce RTX 5090 (31.8 GiB)): planning every "
        "GPU as the smallest (24.0 GiB), as sglang sizes its pools by the smallest rank"
    )
    assert result.memory.vram_bytes == 24564 * MIB
    assert result.summary.startswith("tp 2 × dp 1 on 2 mixed GPUs: ")


def test_p2p_between_all_gpus_keeps_sglangs_custom_all_reduce():
    result = plan_on("4xRTX4090", p2p_ok=True)

    assert result.extra_flags == CHUNK
    assert result.reasons["custom_all_reduce"] == "kept: every pair of GPUs in each tp group has P2P access"


def test_unknown_p2p_counts_as_none():
    gpus = [GpuSpec("NVIDIA GeForce RTX 4090", 24564 * MIB, (8, 9))] * 4

    assert "--disable-custom-all-reduce" in plan(shape=QWEN36, weight_bytes=QWEN36_WEIGHT_BYTES, gpus=gpus).extra_flags
    partly_known = [[True, None, True, True], [None, True, True, True], [True] * 4, [True] * 4]
    result = plan(shape=QWEN36, weight_bytes=QWEN36_WEIGHT_BYTES, gpus=gpus, p2p=partly_known)
    assert "--disable-custom-all-reduce" in result.extra_flags
    assert result.reasons["custom_all_reduce"].startswith("--disable-custom-all-reduce: GPU 0 and GPU 1 have no")


def test_blackwell_gets_the_triton_attention_backend_with_its_reason():
    result = plan_on("2xRTX5090")

    assert result.reasons["attention_backend"].startswith("--attention-backend triton: compute capability 12.x")
    assert "attention_backend" not in plan_on("4xRTX4090").reasons


def test_gpus_older_than_ada_keep_a_bf16_kv_cache_and_serve_fewer_requests():
    rtx3090 = [GpuSpec("NVIDIA GeForce RTX 3090", 24576 * MIB, (8, 6))] * 4
    result = plan(shape=QWEN36, weight_bytes=QWEN36_WEIGHT_BYTES, gpus=rtx3090)

    assert result.kv_cache_dtype == "auto"
    assert result.reasons["kv_cache_dtype"] == (
        "auto (bfloat16): FP8 KV cache needs compute capability 8.9 or newer and the oldest GPU here is 8.6"
    )
    assert (result.tp, result.max_running_requests) == (4, 4), "a bf16 cache holds half the tokens of an fp8 one"


def test_an_unknown_compute_capability_counts_as_too_old_for_fp8_and_gets_no_backend_flag():
    gpus = [GpuSpec("GPU", 24564 * MIB, None)] * 4
    result = plan(shape=QWEN36, weight_bytes=QWEN36_WEIGHT_BYTES, gpus=gpus, p2p=[[True] * 4] * 4)

    assert result.kv_cache_dtype == "auto"
    assert result.extra_flags == CHUNK


def test_context_is_halved_only_when_not_even_one_full_request_fits():
    tight = [GpuSpec("GPU", int(21.4 * GIB), (8, 9))] * 2
    result = plan(shape=QWEN36, weight_bytes=QWEN36_WEIGHT_BYTES, gpus=tight)

    assert result.fits
    assert (result.tp, result.context_length, result.max_running_requests) == (2, 131072, 1)
    assert result.reasons["context_length"].startswith("131072: reduced from 262144")


def test_a_shorter_target_context_lets_more_requests_fit():
    result = plan_on("2xRTX4090", target_context=32768)

    assert (result.tp, result.context_length, result.max_running_requests) == (2, 32768, 8)
    assert result.reasons["context_length"] == "32768: the target context"


def test_a_target_context_beyond_the_model_is_clamped_with_a_reason():
    result = plan_on("4xRTX4090", target_context=1_000_000)

    assert result.context_length == 262144
    assert "the target 1000000 is longer than the model supports" in result.reasons["context_length"]


def test_weights_that_fit_but_leave_no_room_for_any_kv_cache_do_not_fit():
    budget = 24564 * MIB * 83 // 100
    result = plan(shape=QWEN36, weight_bytes=2 * (budget - 10 * MIB), gpus=[GpuSpec("GPU", 24564 * MIB, (8, 9))] * 2)

    assert not result.fits
    assert result.summary.startswith(
        "the weights fit with tp 2 (19.9 GiB per GPU) but leave 10 MiB of the 19.9 GiB budget"
    )


def test_weights_beyond_every_legal_tp_do_not_fit():
    result = plan_on("8xRTX4090")
    huge = plan(shape=QWEN36, weight_bytes=10 * QWEN36_WEIGHT_BYTES, gpus=[GpuSpec("GPU", 24564 * MIB, (8, 9))] * 8)

    assert result.fits
    assert huge.summary.startswith(
        "326.9 GiB of weights do not fit on GPUs of 24.0 GiB even at the largest "
        "tensor-parallel size this model allows (tp 4;"
    )


def test_a_card_smaller_than_the_reserve_does_not_fit():
    result = plan(shape=SMOLLM2, weight_bytes=SMOLLM2_WEIGHT_BYTES, gpus=[GpuSpec("GPU", 4 * GIB, (8, 9))])

    assert result.summary == "GPUs of 4.0 GiB are smaller than the 4.1 GiB sglang needs outside its static pool"


def test_a_gpu_without_a_memory_reading_does_not_fit():
    gpus = detect(nvml=FakeNvml.from_spec("2xRTX4090")).gpus
    blind = (gpus[0], type(gpus[1])(index=1, name="NVIDIA GeForce RTX 4090"))

    result = plan(shape=QWEN36, weight_bytes=QWEN36_WEIGHT_BYTES, gpus=blind)

    assert result.summary == "GPU 1 did not report its memory size; the plan cannot size anything"


def test_smollm2_without_a_gpu_runs_the_reference_server_on_cpu():
    result = plan(shape=SMOLLM2, weight_bytes=SMOLLM2_WEIGHT_BYTES, gpus=[], cpu_capable=True)

    assert result.fits
    assert (result.server, result.device) == ("reference", "cpu")
    assert (result.tp, result.dp, result.max_running_requests, result.max_inflight) == (1, 1, 4, 4)
    assert result.context_length == 8192
    assert result.kv_cache_dtype == "auto"
    assert result.mem_fraction_static is None and result.memory is None
    assert result.extra_flags == ()
    assert result.reasons["server"].startswith(
        "no NVIDIA GPU: the reference server (transformers) runs the model on CPU"
    )
    assert result.summary == (
        "CPU mode: the reference server runs LlamaForCausalLM on CPU (4 concurrent requests of up to 8192 tokens)"
    )


def test_a_gpu_model_without_a_gpu_does_not_fit():
    result = plan(shape=QWEN36, weight_bytes=QWEN36_WEIGHT_BYTES, gpus=[])

    assert not result.fits
    assert (
        result.summary
        == "no NVIDIA GPU found, and 32.7 GiB of weights need GPUs (in CPU mode only the embedded model runs)"
    )


def test_smollm2_on_one_4090_is_a_plain_tp1_sglang_plan():
    result = plan(
        shape=SMOLLM2, weight_bytes=SMOLLM2_WEIGHT_BYTES, gpus=detect(nvml=FakeNvml.from_spec("RTX4090")).gpus
    )

    assert (result.server, result.tp, result.dp, result.context_length, result.max_running_requests) == (
        "sglang",
        1,
        1,
        8192,
        8,
    )
    assert result.extra_flags == CHUNK
    assert "custom_all_reduce" not in result.reasons


def test_legal_tp_sizes_follow_heads_kv_replication_and_fp8_blocks():
    assert legal_tp_sizes(QWEN36, max_tp=16) == (1, 2, 4)
    assert tp_problem(QWEN36, 3) == "16 attention heads do not split 3 ways"
    assert tp_problem(QWEN36, 16) == "moe_intermediate_size 512 / 16 = 32 is not a multiple of the FP8 block 128"
    assert legal_tp_sizes(SMOLLM2, max_tp=9) == (1, 3, 9), "3 KV heads replicate evenly over 9 GPUs"
    six_kv = ModelShape(
        architecture="x",
        hidden_size=1536,
        num_layers=2,
        num_attention_heads=12,
        num_kv_heads=8,
        head_dim=128,
        full_attention_layers=2,
        linear_attention_layers=0,
        max_position_embeddings=4096,
    )
    assert tp_problem(six_kv, 3) == "8 KV heads neither split 3 ways nor replicate evenly over 3 GPUs"


def test_the_memory_fraction_reproduces_the_published_config_and_derives_the_5090s():
    assert mem_fraction_static_for(vram_bytes=24564 * MIB) == 0.83
    assert mem_fraction_static_for(vram_bytes=32607 * MIB) == 0.87
    assert mem_fraction_static_for(vram_bytes=80 * GIB) == 0.90, "capped at sglang's default"
    assert mem_fraction_static_for(vram_bytes=ACTIVATION_RESERVE_BYTES) is None
    # The reserve is what the published 0.83 leaves on a 4090, never more.
    assert 0 <= (1 - 0.83) * 24564 * MIB - ACTIVATION_RESERVE_BYTES < MIB
    assert CHUNKED_PREFILL_SIZE == 8192


def test_read_model_shape_sums_the_shards(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(QWEN36_CONFIG))
    for index, size in enumerate((5 * GIB, 3 * GIB + 7)):
        with open(tmp_path / f"model-{index:05d}.safetensors", "wb") as shard:
            shard.truncate(size)  # sparse: the size is all that is read
    (tmp_path / "tokenizer.json").write_text("{}")

    shape, weight_bytes = read_model_shape(tmp_path)

    assert shape == QWEN36
    assert weight_bytes == 8 * GIB + 7


def test_read_model_shape_names_what_is_missing(tmp_path):
    with pytest.raises(ModelError, match="has no config.json"):
        read_model_shape(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(QWEN36_CONFIG))
    with pytest.raises(ModelError, match=r"has no \*\.safetensors shards"):
        read_model_shape(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelError, match="cannot read"):
        read_model_shape(os.fspath(tmp_path))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"num_attention_heads": None}, "config.json has no 'num_attention_heads'"),
        ({"num_hidden_layers": True}, "config.json has num_hidden_layers=True; expected a positive integer"),
        ({"head_dim": 0}, "config.json has head_dim=0; expected a positive integer"),
        ({"layer_types": ["full_attention"] * 3}, "config.json lists 3 layer_types for 40 layers"),
    ],
)
def test_a_malformed_config_names_the_key(change, message):
    config = {**QWEN36_CONFIG, "text_config": {**QWEN36_CONFIG["text_config"], **change}}

    with pytest.raises(ModelError, match=message.replace("(", r"\(").replace("[", r"\[")):
        model_shape_from_config(config)


def test_a_malformed_quant_block_is_refused():
    config = {**QWEN36_CONFIG, "quantization_config": {"quant_method": "fp8", "weight_block_size": [128]}}

    with pytest.raises(ModelError, match="weight_block_size"):
        model_shape_from_config(config)


def test_without_layer_types_the_full_attention_interval_decides():
    text = {k: v for k, v in QWEN36_CONFIG["text_config"].items() if k != "layer_types"}

    shape = model_shape_from_config({**QWEN36_CONFIG, "text_config": text})

    assert (shape.full_attention_layers, shape.linear_attention_layers) == (10, 30)


@pytest.mark.parametrize(
    "kwargs",
    [{"target_concurrency": 0}, {"target_context": 0}, {"weight_bytes": 0}],
)
def test_caller_bugs_raise_value_errors(kwargs):
    arguments = {"shape": QWEN36, "weight_bytes": QWEN36_WEIGHT_BYTES, "gpus": [], **kwargs}

    with pytest.raises(ValueError, match=next(iter(kwargs))):
        plan(**arguments)


# --- properties -----------------------------------------------------------------------------


@st.composite
def model_shapes(draw) -> ModelShape:
    heads = draw(st.sampled_from([4, 8, 9, 12, 16, 24, 32, 40, 64]))
    kv_heads = draw(st.sampled_from([d for d in range(1, heads + 1) if heads % d == 0]))
    head_dim = draw(st.sampled_from([64, 128, 256]))
    layers = draw(st.integers(1, 64))
    full = draw(st.integers(1, layers))
    linear = layers - full
    moe = draw(st.one_of(st.none(), st.sampled_from([256, 384, 512, 768, 1024, 1536])))
    return ModelShape(
        architecture="Hypothetical",
        hidden_size=heads * head_dim,
        num_layers=layers,
        num_attention_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        full_attention_layers=full,
        linear_attention_layers=linear,
        max_position_embeddings=draw(st.sampled_from([2048, 8192, 32768, 131072, 262144])),
        linear_num_key_heads=draw(st.sampled_from([8, 16])) if linear else None,
        linear_num_value_heads=draw(st.sampled_from([16, 32, 64])) if linear else None,
        linear_key_head_dim=128 if linear else None,
        linear_value_head_dim=128 if linear else None,
        linear_conv_kernel_dim=4 if linear else None,
        intermediate_size=None if moe else draw(st.sampled_from([1536, 4096, 11008, 12288])),
        num_experts=draw(st.sampled_from([64, 128, 256])) if moe else None,
        num_experts_per_tok=8 if moe else None,
        moe_intermediate_size=moe,
        shared_expert_intermediate_size=draw(st.sampled_from([None, moe])) if moe else None,
        quant_method="fp8" if draw(st.booleans()) else None,
    )


@st.composite
def planning_inputs(draw) -> dict:
    shape = draw(model_shapes())
    if shape.quant_method:
        shape = ModelShape(**{**{f: getattr(shape, f) for f in shape.__dataclass_fields__}, "quant_block": (128, 128)})
    count = draw(st.integers(1, 8))
    card = st.tuples(
        st.sampled_from([8 * GIB, 12 * GIB, 16 * GIB, 24564 * MIB, 32607 * MIB, 48 * GIB, 80 * GIB]),
        st.sampled_from([None, (8, 6), (8, 9), (9, 0), (12, 0)]),
    )
    cards = draw(st.lists(card, min_size=count, max_size=count))
    gpus = [GpuSpec(f"GPU {memory // MIB} MiB", memory, cc) for memory, cc in cards]
    p2p = draw(
        st.one_of(
            st.none(),
            st.lists(
                st.lists(st.sampled_from([True, False, None]), min_size=count, max_size=count),
                min_size=count,
                max_size=count,
            ),
        )
    )
    return {
        "shape": shape,
        "weight_bytes": draw(st.integers(100 * MIB, 400 * GIB)),
        "gpus": gpus,
        "p2p": p2p,
        "target_context": draw(st.one_of(st.none(), st.integers(512, 300_000))),
        "target_concurrency": draw(st.integers(1, 64)),
    }


@settings(max_examples=300, deadline=None)
@given(planning_inputs())
def test_every_plan_keeps_its_invariants(inputs):
    result = plan(**inputs)
    shape, gpus = inputs["shape"], inputs["gpus"]

    assert result == plan(**inputs), "the plan is deterministic"
    assert result.max_inflight == result.max_running_requests * result.dp
    assert result.summary
    if not result.fits:
        assert (result.tp, result.dp, result.max_inflight) == (0, 0, 0)
        assert result.reasons["fit"] == result.summary
        return
    assert shape.num_attention_heads % result.tp == 0
    assert tp_problem(shape, result.tp) is None
    assert 1 <= result.tp * result.dp <= len(gpus)
    assert result.dp == len(gpus) // result.tp
    assert 1 <= result.max_running_requests <= inputs["target_concurrency"]
    assert result.context_length <= shape.max_position_embeddings
    memory = result.memory
    assert memory.static_bytes <= memory.budget_bytes
    assert memory.budget_bytes + memory.reserve_bytes == memory.vram_bytes
    assert memory.reserve_bytes >= ACTIVATION_RESERVE_BYTES
    assert {"tp", "dp", "mem_fraction_static", "max_running_requests", "context_length", "kv_cache_dtype"} <= set(
        result.reasons
    )
    p2p = inputs["p2p"]
    groups_have_p2p = p2p is not None and all(
        p2p[a][b] is True
        for g in range(result.dp)
        for a in range(g * result.tp, (g + 1) * result.tp)
        for b in range(g * result.tp, (g + 1) * result.tp)
        if a != b
    )
    assert ("--disable-custom-all-reduce" in result.extra_flags) == (result.tp > 1 and not groups_have_p2p)


@settings(max_examples=300, deadline=None)
@given(planning_inputs())
def test_a_plan_that_meets_the_targets_uses_the_smallest_tp_that_does(inputs):
    result = plan(**inputs)
    if not result.fits or result.max_running_requests < inputs["target_concurrency"]:
        return
    shape, memory = inputs["shape"], result.memory
    kv_dtype_bytes = 1 if result.kv_cache_dtype == "fp8_e4m3" else 2
    for smaller in legal_tp_sizes(shape, max_tp=result.tp - 1):
        per_request = result.context_length * kv_bytes_per_token(
            shape, tp=smaller, kv_dtype_bytes=kv_dtype_bytes
        ) + linear_state_bytes_per_request(shape, tp=smaller)
        need = -(-inputs["weight_bytes"] // smaller) + result.max_running_requests * per_request
        assert need > memory.budget_bytes, f"tp {smaller} would have met the targets too"
