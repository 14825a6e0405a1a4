"""The GEMM capture for sglang (`gemm_capture`), on torch modules shaped as sglang's Llama is
(merged ``qkv_proj`` and ``gate_up_proj`` linears returning ``(out, None)``, RMSNorms that fuse
the residual add in place, a model called with a ForwardBatch) and loaded with SmolLM2's real
weights: the root it commits for a request equals the root the reference server's capture
commits for the same tokens, in a batch beside a request that did not ask; rows it did not see
(a radix-cache prefix, a CUDA-graph decode step) are refused, not committed; its loopback server
opens what it committed; behind `SglangStandIn`, the miner's `ServeClient` gets sglang's answer
and the capture commits it. No sglang here: the fakes (`llama_like`) copy sglang's structure
(``sglang/srt/models/llama.py``), and the attention between the GEMMs is transformers' own, so
the two captures see the same numbers.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
import torch.nn.functional as F
import trio

from engy_node.gemm.activations import Commitment, Opening, group_values, llama_layout, verify_opening
from engy_node.miner.sglang import gemm_capture as gc
from engy_node.serve.capture import ActivationCapture, SharedOpenings
from engy_node.serve.client import ServeClient
from tests.engy_node.miner.sglang.llama_like import LlamaForCausalLM, Scheduler, SglangStandIn

PROMPT = [1, 504, 3575, 282, 4649, 314]
FED = [29, 7390, 30]
"""Output tokens fed back after the prompt (any tokens do: both captures are handed the same)."""
POSITIONS = len(PROMPT) + len(FED)


def serve(scheduler: Scheduler, rid: str, *, other: str | None = None) -> None:
    """Prefill `rid`'s PROMPT, then decode FED one at a time; `other`, when given, rides in every
    batch with a prompt and outputs of its own."""
    other_prompt = [1, 9690, 198, 2683, 314, 253, 1232]
    prefill = [(rid, PROMPT, 0)] + ([(other, other_prompt, 0)] if other else [])
    scheduler.run("EXTEND", prefill[::-1])
    for step, token in enumerate(FED):
        decode = [(rid, [token], len(PROMPT) + step)]
        if other:
            decode.insert(0, (other, [17], len(other_prompt) + step))
        scheduler.run("DECODE", decode)


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
    serve(scheduler, "engy-gemm-a")
    wire = capture.commit("engy-gemm-a", POSITIONS)
    assert wire["activations_root"] == reference_root
    assert wire["arithmetic"] == "bfloat16" and "weights_root" not in wire
    assert capture.commit("engy-gemm-a", POSITIONS) == wire  # asked again: the same


def test_in_a_batch_with_one_that_did_not_ask_only_the_asking_request_is_recorded(sglang, reference_root):
    capture, scheduler = sglang
    serve(scheduler, "engy-gemm-b", other="plain-request")
    assert capture.commit("engy-gemm-b", POSITIONS)["activations_root"] == reference_root
    with pytest.raises(gc.CaptureRefused, match="no captured rows") as refused:
        capture.commit("plain-request", 10)
    assert refused.value.status == 404


def test_rows_past_the_answer_are_left_out_and_a_short_record_is_refused(sglang, reference_root):
    capture, scheduler = sglang
    serve(scheduler, "engy-gemm-c")
    scheduler.run("DECODE", [("engy-gemm-c", [11], POSITIONS)])  # the overlap scheduler's extra step
    assert capture.commit("engy-gemm-c", POSITIONS)["activations_root"] == reference_root
    serve(scheduler, "engy-gemm-d")
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
    serve(scheduler, "engy-gemm-g")
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


async def test_the_miners_client_gets_sglangs_answer_from_the_stand_in_and_the_capture_commits_it(
    sglang_model, hf_model, runner, layout
):
    """`SglangStandIn` with the capture armed, met as the miner meets sglang: `ServeClient` gets
    the greedy answer with one hidden row per token, streamed or not, and the opening server
    commits every position that answer covers (prompt + output − 1)."""
    stand_in = SglangStandIn(sglang_model, hf_model, capture=gc.SglangCapture(layout, SharedOpenings()))
    async with httpx.AsyncClient(timeout=120) as http, trio.open_nursery() as nursery:
        await nursery.start(stand_in.run)
        client = ServeClient(stand_in.url, http)
        result = await client.generate(PROMPT, {"temperature": 0.0}, max_new_tokens=4, rid_prefix="engy-gemm-x")
        streamed = await client.generate(
            PROMPT, {"temperature": 0.0}, max_new_tokens=4, rid_prefix="engy-gemm-y", stream=True
        )
        positions = len(PROMPT) + len(result.output_ids) - 1
        committed = await http.get(
            f"{stand_in.capture_url}/gemm/commitment/engy-gemm-x-0", params={"positions": positions}
        )
        nursery.cancel_scope.cancel()
    assert committed.status_code == 200 and committed.json()["positions"] == positions
    cache, ids, rows = runner.new_cache(), [], []
    hidden, logits = runner.forward(PROMPT, cache)
    while True:
        ids.append(int(logits.argmax()))
        rows.append(hidden[-1].float().tolist())
        if len(ids) == 4:
            break
        hidden, logits = runner.forward(ids[-1:], cache)
    assert result.output_ids == ids and result.finish_reason == {"type": "length", "length": 4}
    assert result.hidden_rows == rows
    assert (streamed.output_ids, streamed.hidden_rows) == (ids, rows)
    assert [body["rid"] for body in stand_in.bodies] == ["engy-gemm-x-0", "engy-gemm-y-0"]
    assert stand_in.bodies[0]["sampling_params"] == {"temperature": 0.0, "max_new_tokens": 4}


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
    assert entry is not None and entry.positions == 3 and not entry.broken and entry.nbytes == 30
    assert np.concatenate([c for _, c in entry.chunks]).tolist() == [rows[0].tolist(), *(rows[:2] + 100).tolist()]
    pending.add("old", 0, rows)
    pending.add("new", 0, rows[:2])  # 50 bytes together: the newcomer is refused, the running one kept
    new = pending.take("new")
    assert new is not None and "would pass its 40 bytes" in new.broken and "--max-running-requests" in new.broken
    pending.add("old", 3, rows[:1])  # its next step still fits
    old = pending.take("old")
    assert old is not None and not old.broken and old.positions == 4
    pending.add("late", 0, rows)
    clock[0] = 11.0
    assert pending.take("late") is None, "untouched for the window: gone"
    pending.add("again", 0, rows[:2])
    pending.add("again", 2, rows[:2])  # 40 bytes: fits exactly now that the rest left
    assert pending.take("again").nbytes == 40


def test_concurrent_answers_that_each_fit_are_all_committed(sglang_model, layout, reference_root):
    """Two answers in flight together, their rows within the store's bytes, both commit."""
    openings = SharedOpenings(max_bytes=3 * POSITIONS * layout.bytes_per_position())
    capture = gc.SglangCapture(layout, openings)
    handles = capture.attach(sglang_model)
    try:
        scheduler = Scheduler(sglang_model)
        prefill = [(rid, PROMPT, 0) for rid in ("engy-gemm-p", "engy-gemm-q")]
        scheduler.run("EXTEND", prefill)
        for step, token in enumerate(FED):
            scheduler.run("DECODE", [(rid, [token], len(PROMPT) + step) for rid in ("engy-gemm-p", "engy-gemm-q")])
        assert capture.commit("engy-gemm-p", POSITIONS)["activations_root"] == reference_root
        scheduler.run("DECODE", [("engy-gemm-p", [11], POSITIONS)])  # the overlap scheduler's extra step
        assert capture.commit("engy-gemm-q", POSITIONS)["activations_root"] == reference_root
        assert capture.pending.take("engy-gemm-p") is None, "a committed request's extra step keeps nothing"
    finally:
        for handle in handles:
            handle.remove()


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
