"""Sampled GEMM audits (docs/verification.md, "GEMM audits"): Merkle commitments to a checkpoint's
weight matrices (merkle, layout, commitment, checkpoint, spec), so a verifier can later open single
rows of the matrices a miner multiplied by and check the products it committed to.

Core layer: it imports no role; the miner, the reference server and the verifier build on it."""
