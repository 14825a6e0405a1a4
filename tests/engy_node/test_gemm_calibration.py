"""`engy-node calibrate --gemm-audits N` through the CLI (issue 32): each answer of its cases is
GEMM-audited beside TOPLOC's verdict on the same answer, and the table says so. One prompt, a
few tokens, honest serving and 1 % weight noise (which TOPLOC misses and every audit catches,
docs/verification.md): the audit never judges the honest answer a cheat, and catches the noise."""

from __future__ import annotations

import os
import subprocess
import sys


def calibrate(home, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "engy_node", "--home", str(home), "calibrate", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )


def rows_of(table: str) -> dict[str, list[str]]:
    return {
        cells[0]: cells
        for line in table.splitlines()
        if line.startswith("| ") and not line.startswith("| case")
        for cells in [[cell.strip() for cell in line.strip("|").split("|")]]
    }


def test_gemm_audits_join_toplocs_verdict_in_calibrate(checkpoint, tmp_path):
    result = calibrate(
        tmp_path,
        "--gemm-audits",
        "2",
        "--prompts",
        "1",
        "--max-new-tokens",
        "8",
        "--gemm-cases",
        "honest,noise-1%",
    )
    assert result.returncode == 0, result.stderr
    assert "## GEMM audits beside TOPLOC (2 audits per answer)" in result.stdout
    rows = rows_of(result.stdout)
    assert set(rows) == {"honest", "noise-1%"}, result.stdout
    # case | expected | answers | GEMM judged cheat | GEMM reasons | TOPLOC judged cheat | TOPLOC reasons
    assert rows["honest"][1:4] == ["pass", "1", "0/2 (0.0–84.2 %)"]
    assert rows["honest"][5].startswith("0/1")
    assert rows["noise-1%"][3].startswith("2/2 "), result.stdout
    assert rows["noise-1%"][4].startswith("gemm:")
    assert "UNEXPECTED" not in result.stderr


def test_an_unknown_gemm_case_names_the_cases_before_serving(tmp_path):
    result = calibrate(tmp_path, "--gemm-audits", "1", "--gemm-cases", "honest,noise-2%")
    assert result.returncode != 0
    assert "--gemm-cases: unknown noise-2%; the cases are honest, quantised-4bit" in result.stderr


def test_what_fails_calibrate_follows_its_exit_rules():
    from engy_node.verifier.gemm_calibration import GemmCaseResult, gemm_unexpected

    results = [
        GemmCaseResult("honest", "pass", 0, ("pass", "pass"), "pass"),
        GemmCaseResult("honest", "pass", 1, ("pass", "cheat/gemm:rows-q-proj"), "pass"),
        GemmCaseResult("quantised-4bit", "cheat", 0, ("pass",), "pass"),
        GemmCaseResult("quantised-4bit", "cheat", 1, ("pass",), "cheat/chunks"),
        GemmCaseResult("prefill-attack", "cheat", 0, ("pass",), "pass"),
        GemmCaseResult("final-norm-x1.05", None, 0, ("pass",), "pass"),
    ]
    assert gemm_unexpected(results) == [
        "honest prompt 1: GEMM gemm:rows-q-proj 1, TOPLOC pass; expected pass",
        "prefill-attack: caught by neither the GEMM audit nor TOPLOC; expected cheat",
    ]
