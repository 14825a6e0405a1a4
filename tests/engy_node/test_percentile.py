"""The one percentile: nearest rank on the percentile as written (the property tests over random
inputs are in test_metrics.py, which the dashboards' percentiles share)."""

import pytest

from engy_node.percentile import checked, nearest_rank


@pytest.mark.parametrize(("q", "rank"), [(99.9, 999), (99.99, 1000), (0.1, 1), (7, 70), (50, 500), (100, 1000)])
def test_the_rank_is_exact_for_a_percentile_written_in_decimal(q, rank):
    # The float nearest to 99.9 is a little above it: as a binary fraction it would round up to rank 1,000.
    assert nearest_rank(list(range(1, 1001)), q) == rank


@pytest.mark.parametrize("q", [0, -1, 100.5, float("nan"), float("inf")])
def test_a_percentile_outside_0_to_100_is_refused(q):
    with pytest.raises(ValueError, match="percentile must be in"):
        checked(q)
