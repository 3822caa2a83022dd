"""A host's client slices are made on first use and bounded in number (issue 17's memory at 100,000 clients)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from raysim.data.federation import ClientSlices, FederationData


def _fed(num_clients: int) -> FederationData:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4 * num_clients, 3)).astype(np.float32)
    y = np.arange(4 * num_clients) % 2
    idx = [np.arange(4 * c, 4 * c + 4) for c in range(num_clients)]
    return FederationData(x, y, x, y, idx, idx, ["a", "b"])


def test_slices_are_lazy_bounded_and_equal_when_rebuilt():
    fed = _fed(10)
    s = ClientSlices(fed, [7, 2, 5], keep=2)
    assert list(s) == [2, 5, 7] and len(s) == 3 and 5 in s
    assert len(s._cache) == 0  # nothing is built up front
    first = s[2]
    assert s[2] is first  # kept while recently used
    s[5], s[7]  # a third client evicts the least recently used (2)
    assert len(s._cache) == 2 and 2 not in s._cache
    again = s[2]
    assert again is not first
    # the same rows: a slice is a pure function of the arrays (a copy of the same float32 values, exact)
    assert torch.equal(again.x_train, first.x_train) and torch.equal(again.y_test, first.y_test)
    assert torch.equal(first.x_train, torch.from_numpy(fed.x_train[8:12]))
    with pytest.raises(KeyError):
        s[3]  # not one of this host's clients
