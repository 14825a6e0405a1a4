"""What "the model chose this token" can mean in a bf16 recompute.

On CPUs with AMX / AVX512-bf16 kernels, a decode step and a prefill over the same tokens can
round a near-tie to different winners (seen on this project's CI machines: an exact 0.0 gap
between the top two logits). So a test that each emitted token is the recompute's choice
allows the emitted token to be the top choice up to bf16 rounding, instead of testing the
kernels' tie-breaking.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

BF16_LOGIT_SLACK = 0.25
"""Two bf16 rounding steps at this model's logit scale (~10-30, where one step is 0.125)."""


def assert_top_choices(logits: torch.Tensor, emitted: Sequence[int]) -> None:
    """Each row of `logits` scores the emitted token within the slack of the row's best."""
    rows = logits.float()
    scores = rows.gather(-1, torch.tensor(list(emitted)).unsqueeze(-1)).squeeze(-1)
    gaps = rows.max(-1).values - scores
    assert gaps.max().item() <= BF16_LOGIT_SLACK, f"emitted tokens fall short of the top logit by {gaps.tolist()}"
