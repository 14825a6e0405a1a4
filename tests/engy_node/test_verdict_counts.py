"""Verdict tallies by the proof that judged them (`engy_node.verdict_counts`)."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given
from hypothesis import strategies as st

from engy_node import proof
from engy_node.snapshots import decode, encode
from engy_node.verdict_counts import PROOFS, ProofVerdicts, VerdictCounts, judged_by


@pytest.mark.parametrize(
    ("code", "judge"),
    [
        ("ok", "toploc"),
        ("chunks", "toploc"),
        ("defect:whitespace", "toploc"),
        ("shape:prompt_ids", "toploc"),
        ("usage-padding", "toploc"),
        ("prompt-mismatch", "toploc"),
        ("recompute:tokens", "recompute"),
        ("recompute:shape:prompt_ids", "recompute"),
        ("gemm:no-opening", "gemm"),
        ("gemm:opening", "gemm"),
        ("gemm:o_proj", "gemm"),
        ("gemm", "toploc"),
        ("gemmy:x", "toploc"),
        ("", "toploc"),
    ],
)
def test_the_proof_is_read_from_the_codes_prefix(code, judge):
    assert judged_by(code) == judge


@pytest.mark.parametrize("path", PROOFS)
def test_every_verdicts_code_names_the_path_it_came_from(path):
    for reason in ("ok", "shape:prompt_ids", "no-opening"):
        assert judged_by(proof.Verdict("pass", reason, path=path).code) == path


verdicts = st.lists(
    st.tuples(st.sampled_from(["pass", "cheat", "unproven"]), st.sampled_from(["ok", "gemm:rows", "recompute:x"]))
)


@given(verdicts)
def test_the_split_adds_up_to_the_total_and_survives_the_wire(judged):
    counts, split = VerdictCounts(), ProofVerdicts()
    for kind, code in judged:
        counts, split = counts.counted(kind), split.counted(kind, code)
    parts = [getattr(split, name) for name in PROOFS]
    for field in dataclasses.fields(VerdictCounts):
        assert sum(getattr(part, field.name) for part in parts) == getattr(counts, field.name)
    assert counts.total == len(judged)
    assert decode(ProofVerdicts, encode(split), strict=True) == split
    assert encode(VerdictCounts(passed=1)) == {"pass": 1, "cheat": 0, "unproven": 0}
