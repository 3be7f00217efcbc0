"""Which norms of an offloaded gradient are its whole 2-norm (served) and which are refused, as torch answers them."""

from __future__ import annotations

import pytest
import torch

from runtime.engine.clipping import _whole_two_norm_shape


@pytest.mark.parametrize("order", [2, "fro"])
def test_linalg_norm_with_an_order_of_a_3d_gradient_is_refused_as_torch_refuses_it(order):
    g = torch.ones(2, 3, 4)
    with pytest.raises(RuntimeError, match="must be 1D or 2D"):
        torch.linalg.norm(g, order)  # torch's own answer
    with pytest.raises(RuntimeError, match="3 dimensions with no dim: torch refuses it"):
        _whole_two_norm_shape(torch.linalg.norm, "norm", (g, order), {})


def test_the_whole_2_norm_of_a_3d_gradient_is_served_as_torch_serves_it():
    g = torch.ones(2, 3, 4)
    assert _whole_two_norm_shape(torch.linalg.norm, "norm", (g,), {}) == ()  # no order: the vector 2-norm
    assert _whole_two_norm_shape(torch.linalg.vector_norm, "vector_norm", (g, 2), {}) == ()
    assert _whole_two_norm_shape(torch.Tensor.norm, "norm", (g, 2), {"keepdim": True, "dim": (0, 1, 2)}) == (1, 1, 1)
