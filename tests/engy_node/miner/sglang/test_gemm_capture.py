"""The GEMM capture for sglang (`gemm_capture`), on torch modules shaped as sglang's Llama is
(merged ``qkv_proj`` and ``gate_up_proj`` linears returning ``(out, None)``, RMSNorms that fuse
the residual add in place, a model called with a ForwardBatch) and loaded with SmolLM2's real
weights: the root it commits for a request equals the root the reference server's capture
commits for the same tokens, in a batch beside a request that did not ask; rows it did not see
(a radix-cache prefix, a CUDA-graph decode step) are refused, not committed; its loopback server
opens what it committed. No sglang here: the fakes copy sglang's structure
(``sglang/srt/models/llama.py``), and the attention between the GEMMs is transformers' own, so
the two captures see the same numbers.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import httpx
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from engy_node.gemm.activations import Commitment, Opening, group_values, llama_layout, verify_opening
from engy_node.miner.sglang import gemm_capture as gc
from engy_node.serve.capture import ActivationCapture, SharedOpenings

PROMPT = [1, 504, 3575, 282, 4649, 314]
FED = [29, 7390, 30]
"""Output tokens fed back after the prompt (any tokens do: both captures are handed the same)."""
POSITIONS = len(PROMPT) + len(FED)


class Linear(nn.Module):
    """sglang's QKVParallelLinear / MergedColumnParallelLinear / RowParallelLinear at tp 1, with
    batch-invariant products as under ``--enable-deterministic-inference`` (which the miner
    launches with): each request's rows are multiplied alone, so a row's bits do not depend on
    what else is in its batch (a CPU matmul's kernel follows the row count)."""

    spans: tuple[tuple[int, int], ...] = ()
    """(first row, rows) of each request in the batch running now (set by `Scheduler.run`)."""

    def __init__(self, *weights: torch.Tensor) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.cat(weights), requires_grad=False)

    def forward(self, x):
        return torch.cat([F.linear(x[row : row + count], self.weight) for row, count in self.spans]), None


class RMSNorm(nn.Module):
    """sglang's RMSNorm as its CUDA path runs: with a residual, both inputs are overwritten (the
    sum into ``residual``, the normed sum into ``x``) and returned; the norm is transformers'."""

    def __init__(self, hf_norm: nn.Module) -> None:
        super().__init__()
        self.hf_norm = hf_norm

    def forward(self, x, residual=None):
        if residual is None:
            return self.hf_norm(x)
        residual.copy_(x + residual)
        x.copy_(self.hf_norm(residual))
        return x, residual


class Attention(nn.Module):
    def __init__(self, hf_attention: nn.Module, rotary: nn.Module, layer: int) -> None:
        super().__init__()
        self.qkv_proj = Linear(hf_attention.q_proj.weight, hf_attention.k_proj.weight, hf_attention.v_proj.weight)
        self.o_proj = Linear(hf_attention.o_proj.weight)
        self.hf = hf_attention
        self.rotary = rotary
        self.layer = layer
        self.sizes = [
            hf_attention.q_proj.out_features,
            hf_attention.k_proj.out_features,
            hf_attention.v_proj.out_features,
        ]

    def forward(self, positions, hidden_states, forward_batch):
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        qkv, _ = self.qkv_proj(hidden_states)
        q, k, v = qkv.split(self.sizes, dim=-1)
        attend = ALL_ATTENTION_FUNCTIONS.get_interface(self.hf.config._attn_implementation, None)
        outputs = []
        for rid, row, count in forward_batch.spans:
            rows = slice(row, row + count)
            shape = (1, count, -1, self.hf.head_dim)
            qi, ki, vi = (t[rows].reshape(shape).transpose(1, 2) for t in (q, k, v))
            cos, sin = self.rotary(hidden_states[None, rows], positions[None, rows])
            qi, ki = apply_rotary_pos_emb(qi, ki, cos, sin)
            cached = forward_batch.kv.get((rid, self.layer))
            if cached is not None:
                ki, vi = torch.cat([cached[0], ki], dim=-2), torch.cat([cached[1], vi], dim=-2)
            forward_batch.kv[rid, self.layer] = (ki, vi)
            out, _ = attend(self.hf, qi, ki, vi, None, dropout=0.0, scaling=self.hf.scaling)
            outputs.append(out.reshape(count, -1))
        output, _ = self.o_proj(torch.cat(outputs).contiguous())
        return output


class MLP(nn.Module):
    def __init__(self, hf_mlp: nn.Module) -> None:
        super().__init__()
        self.gate_up_proj = Linear(hf_mlp.gate_proj.weight, hf_mlp.up_proj.weight)
        self.down_proj = Linear(hf_mlp.down_proj.weight)

    def forward(self, x):
        gate_up, _ = self.gate_up_proj(x)
        half = gate_up.shape[-1] // 2
        x, _ = self.down_proj(F.silu(gate_up[..., :half]) * gate_up[..., half:])
        return x


class DecoderLayer(nn.Module):
    """sglang's LlamaDecoderLayer.forward, line for line."""

    def __init__(self, hf_layer: nn.Module, rotary: nn.Module, index: int) -> None:
        super().__init__()
        self.self_attn = Attention(hf_layer.self_attn, rotary, index)
        self.mlp = MLP(hf_layer.mlp)
        self.input_layernorm = RMSNorm(hf_layer.input_layernorm)
        self.post_attention_layernorm = RMSNorm(hf_layer.post_attention_layernorm)

    def forward(self, positions, hidden_states, forward_batch, residual):
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions=positions, hidden_states=hidden_states, forward_batch=forward_batch)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        hidden_states = self.mlp(hidden_states)
        return hidden_states, residual


class LlamaModel(nn.Module):
    def __init__(self, hf_model: nn.Module) -> None:
        super().__init__()
        inner = hf_model.model
        self.embed_tokens = inner.embed_tokens
        self.layers = nn.ModuleList(DecoderLayer(layer, inner.rotary_emb, i) for i, layer in enumerate(inner.layers))
        self.norm = RMSNorm(inner.norm)

    def forward(self, input_ids, positions, forward_batch, input_embeds=None, pp_proxy_tensors=None):
        hidden_states, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            hidden_states, residual = layer(positions, hidden_states, forward_batch, residual)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class LlamaForCausalLM(nn.Module):
    def __init__(self, hf_model: nn.Module) -> None:
        super().__init__()
        self.model = LlamaModel(hf_model)
        self.config = hf_model.config

    def forward(self, input_ids, positions, forward_batch):
        return self.model(input_ids, positions, forward_batch)


class Scheduler:
    """Builds ForwardBatches the way sglang does (the fields the capture reads) and runs them."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.kv: dict = {}

    def run(self, mode: str, requests: list[tuple[str, list[int], int]]) -> None:
        """`requests`: (rid, tokens, position of the first) for each request of the batch."""
        spans, row = [], 0
        for rid, tokens, _ in requests:
            spans.append((rid, row, len(tokens)))
            row += len(tokens)
        extend = mode != "DECODE"
        batch = SimpleNamespace(
            forward_mode=SimpleNamespace(name=mode),
            rids=[rid for rid, _, _ in requests],
            extend_seq_lens_cpu=[len(t) for _, t, _ in requests] if extend else None,
            extend_prefix_lens_cpu=[p for _, _, p in requests] if extend else None,
            seq_lens_cpu=torch.tensor([p + len(t) for _, t, p in requests]),
            seq_lens=None,
            spans=spans,
            kv=self.kv,
        )
        Linear.spans = tuple((row, count) for _, row, count in spans)
        ids = torch.tensor([t for _, tokens, _ in requests for t in tokens])
        positions = torch.tensor([p + i for _, tokens, p in requests for i in range(len(tokens))])
        with torch.inference_mode():
            self.model(ids, positions, batch)

    def serve(self, rid: str, *, other: str | None = None) -> None:
        """Prefill `rid`'s prompt, then decode FED one at a time; `other`, when given, rides in
        every batch with a prompt and outputs of its own."""
        other_prompt = [1, 9690, 198, 2683, 314, 253, 1232]
        prefill = [(rid, PROMPT, 0)] + ([(other, other_prompt, 0)] if other else [])
        self.run("EXTEND", prefill[::-1])
        for step, token in enumerate(FED):
            decode = [(rid, [token], len(PROMPT) + step)]
            if other:
                decode.insert(0, (other, [17], len(other_prompt) + step))
            self.run("DECODE", decode)


@pytest.fixture(scope="module")
def hf_model(runner):
    return runner.model


@pytest.fixture(scope="module")
def layout(hf_model):
    return llama_layout(hf_model.config.to_dict(), "bfloat16")


@pytest.fixture(scope="module")
def reference_root(runner, layout) -> str:
    """The root `engy-node serve` commits for PROMPT then FED (its capture on its own runner)."""
    capture = ActivationCapture(layout, SharedOpenings(), weights_root="", arithmetic="bfloat16")
    cache = runner.new_cache()
    runner.forward(PROMPT, cache, capture)
    for token in FED:
        runner.forward([token], cache, capture)
    wire = capture.commit("reference")
    assert wire["positions"] == POSITIONS
    return wire["activations_root"]


@pytest.fixture(scope="module")
def sglang_model(hf_model):
    return LlamaForCausalLM(hf_model)


@pytest.fixture
def sglang(sglang_model, layout):
    model = sglang_model
    capture = gc.SglangCapture(layout, SharedOpenings())
    handles = capture.attach(model)
    yield capture, Scheduler(model)
    for handle in handles:
        handle.remove()


def test_a_request_that_asked_commits_the_reference_servers_root(sglang, reference_root):
    capture, scheduler = sglang
    scheduler.serve("engy-gemm-a")
    wire = capture.commit("engy-gemm-a", POSITIONS)
    assert wire["activations_root"] == reference_root
    assert wire["arithmetic"] == "bfloat16" and "weights_root" not in wire
    assert capture.commit("engy-gemm-a", POSITIONS) == wire  # asked again: the same


def test_in_a_batch_with_one_that_did_not_ask_only_the_asking_request_is_recorded(sglang, reference_root):
    capture, scheduler = sglang
    scheduler.serve("engy-gemm-b", other="plain-request")
    assert capture.commit("engy-gemm-b", POSITIONS)["activations_root"] == reference_root
    with pytest.raises(gc.CaptureRefused, match="no captured rows") as refused:
        capture.commit("plain-request", 10)
    assert refused.value.status == 404


def test_rows_past_the_answer_are_left_out_and_a_short_record_is_refused(sglang, reference_root):
    capture, scheduler = sglang
    scheduler.serve("engy-gemm-c")
    scheduler.run("DECODE", [("engy-gemm-c", [11], POSITIONS)])  # the overlap scheduler's extra step
    assert capture.commit("engy-gemm-c", POSITIONS)["activations_root"] == reference_root
    scheduler.serve("engy-gemm-d")
    with pytest.raises(gc.CaptureRefused, match="--disable-cuda-graph"):
        capture.commit("engy-gemm-d", POSITIONS + 1)


def test_a_prefix_from_the_radix_cache_or_a_step_the_hooks_missed_is_refused(sglang):
    capture, scheduler = sglang
    scheduler.run("EXTEND", [("engy-gemm-e", PROMPT, 0)])
    scheduler.run("EXTEND", [("engy-gemm-cached", PROMPT[3:], 3)])
    scheduler.run("DECODE", [("engy-gemm-e", [FED[0]], len(PROMPT) + 1)])  # position 6 ran in a graph
    with pytest.raises(gc.CaptureRefused, match="--disable-radix-cache"):
        capture.commit("engy-gemm-cached", 3)
    with pytest.raises(gc.CaptureRefused, match="positions 6..6 were not captured.*--disable-cuda-graph"):
        capture.commit("engy-gemm-e", 7)


def test_a_speculative_batch_marks_the_asking_request_and_serving_goes_on(sglang):
    capture, scheduler = sglang
    scheduler.run("TARGET_VERIFY", [("engy-gemm-f", PROMPT, 0)])
    with pytest.raises(gc.CaptureRefused, match="TARGET_VERIFY forward pass is not captured"):
        capture.commit("engy-gemm-f", len(PROMPT))


def test_the_loopback_server_commits_and_opens_what_was_captured(sglang, layout):
    capture, scheduler = sglang
    scheduler.serve("engy-gemm-g")
    server = gc.serve(capture, 0)
    try:
        base = f"http://127.0.0.1:{server.server_address[1]}"
        with httpx.Client(base_url=base, timeout=30) as client:
            assert client.get("/gemm/commitment/engy-gemm-g").status_code == 400
            wire = client.get("/gemm/commitment/engy-gemm-g", params={"positions": POSITIONS}).json()
            picks = [{"position": p, "layer": 3, "group": g} for p in (0, POSITIONS - 1) for g in ("q", "up")]
            picks.append({"position": 2, "layer": layout.layers - 1, "group": "residual_out"})
            answer = client.post("/gemm/openings", json={"rid": "engy-gemm-g", "picks": picks}).json()
            assert answer["activations_root"] == wire["activations_root"] and answer["positions"] == POSITIONS
            commitment = Commitment.from_wire(wire)
            assert all(verify_opening(commitment, Opening.from_wire(o)) for o in answer["openings"])
            assert client.post("/gemm/openings", json={"rid": "gone", "picks": picks}).status_code == 404
            assert client.post("/gemm/openings", json={"rid": "engy-gemm-g", "picks": []}).status_code == 400
            missing = client.get("/gemm/commitment/engy-gemm-never", params={"positions": 3})
            assert missing.status_code == 404 and "engy-gemm-" in missing.json()["error"]["message"]
    finally:
        server.shutdown()
        server.server_close()


def test_q_k_v_and_gate_up_are_the_merged_gemms_columns(sglang, hf_model, layout):
    """The split is by the layout's widths: the committed q row is qkv_proj's first columns."""
    capture, scheduler = sglang
    scheduler.run("EXTEND", [("engy-gemm-h", PROMPT, 0)])
    record = capture.openings.open  # filed on commit
    capture.commit("engy-gemm-h", len(PROMPT))
    opened = record("engy-gemm-h", [(4, 1, "q")])
    assert opened is not None
    (gemms,) = opened[1]
    x, q, v = (
        torch.from_numpy(group_values(layout, gemms, 1, group).astype(np.float32)).to(torch.bfloat16)
        for group in ("attn_in", "q", "v")
    )
    attention = hf_model.model.layers[1].self_attn
    with torch.inference_mode():
        assert torch.equal(F.linear(x, attention.q_proj.weight), q)
        assert torch.equal(F.linear(x, attention.v_proj.weight), v)


def test_pending_rows_are_recomputed_in_place_and_bounded():
    clock = [0.0]
    pending = gc.PendingRows(max_bytes=40, window_s=10, clock=lambda: clock[0])
    rows = np.arange(30, dtype=np.uint8).reshape(3, 10)
    pending.add("r", 0, rows)
    pending.add("r", 1, rows[:2] + 100)  # sglang retracted and recomputed from position 1
    entry = pending.take("r")
    assert entry is not None and entry.positions == 3 and not entry.broken
    assert np.concatenate([c for _, c in entry.chunks]).tolist() == [rows[0].tolist(), *(rows[:2] + 100).tolist()]
    pending.add("old", 0, rows)
    pending.add("new", 0, rows[:2])  # 50 bytes together: the oldest goes
    assert pending.take("old") is None
    clock[0] = 11.0
    assert pending.take("new") is None


def test_plan_rows_maps_each_asking_request_to_its_rows():
    spans, broken = gc.plan_rows(
        ["a", "engy-gemm-1", "engy-gemm-2"],
        "MIXED",
        extend_lens=[4, 3, 1],
        prefix_lens=[0, 2, 9],
        seq_lens=None,
        total_rows=8,
    )
    assert spans == [gc.RowSpan("engy-gemm-1", 4, 3, 2), gc.RowSpan("engy-gemm-2", 7, 1, 9)] and not broken
    spans, broken = gc.plan_rows(
        ["engy-gemm-1"], "DECODE", extend_lens=None, prefix_lens=None, seq_lens=[12], total_rows=1
    )
    assert spans == [gc.RowSpan("engy-gemm-1", 0, 1, 11)]
    _, broken = gc.plan_rows(["engy-gemm-1"], "DECODE", extend_lens=None, prefix_lens=None, seq_lens=[5], total_rows=2)
    assert "do not match" in broken["engy-gemm-1"]
    assert gc.plan_rows(["a"], "TARGET_VERIFY", extend_lens=None, prefix_lens=None, seq_lens=None, total_rows=1) == (
        [],
        {},
    )


def test_the_sitecustomize_shim_wraps_sglangs_load_model_only_when_the_port_is_set(tmp_path: Path):
    """A stand-in `sglang.srt.model_executor.model_runner` on the path: with the port set, the
    shim replaces `ModelRunner.load_model`; without it, nothing is imported or changed."""
    package = tmp_path / "sglang" / "srt" / "model_executor"
    package.mkdir(parents=True)
    for folder in (tmp_path / "sglang", tmp_path / "sglang" / "srt", package):
        (folder / "__init__.py").write_text("")
    (package / "model_runner.py").write_text("class ModelRunner:\n    def load_model(self):\n        pass\n")
    shim = Path(gc.__file__).parent / "capture_site"
    probe = (
        "import sys; from sglang.srt.model_executor import model_runner as m; "
        "print(m.ModelRunner.load_model.__name__, m.ModelRunner.load_model.__module__, 'engy_gemm_capture' in sys.modules)"
    )
    env = {k: v for k, v in os.environ.items() if k != gc.PORT_ENV}
    env["PYTHONPATH"] = os.pathsep.join([str(shim), str(tmp_path)])
    plain = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120)
    assert plain.stdout.split() == ["load_model", "sglang.srt.model_executor.model_runner", "False"], plain.stderr
    armed = subprocess.run(
        [sys.executable, "-c", probe], env={**env, gc.PORT_ENV: "1"}, capture_output=True, text=True, timeout=120
    )
    assert armed.stdout.split() == ["load_model", "engy_gemm_capture", "True"], armed.stderr
