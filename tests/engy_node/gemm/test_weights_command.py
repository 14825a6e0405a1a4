"""`engy-node weights commit`: prints the roots, writes a spec that reads back, names the fix."""

from __future__ import annotations

from engy_node.cli import main
from engy_node.gemm.spec import read_spec

from .synthetic import config, dense_tensors, write_checkpoint


def test_weights_commit_prints_the_root_and_writes_the_spec(tmp_path, capsys):
    directory = write_checkpoint(tmp_path / "ckpt", dense_tensors(), config())
    out = tmp_path / "spec.json.gz"
    assert main(["weights", "commit", "--checkpoint", str(directory), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    root = read_spec(out).weights_root.hex()
    assert f"weights_root  {root}" in printed
    assert "layers        2 (0 MoE)" in printed and "no catalog model pins this root" in printed


def test_weights_commit_on_a_directory_without_a_model_says_so(tmp_path, capsys):
    assert main(["weights", "commit", "--checkpoint", str(tmp_path)]) == 2
    assert "has no config.json; point --checkpoint at a model directory" in capsys.readouterr().err
