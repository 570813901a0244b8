"""The kernel-summed weight gradient of pooled lookups against torch's own autograd."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from tierstore.nn import pooled_lookup
from tierstore.nn.pooled_lookup import LocalIds


@st.composite
def bags(draw):
    """``(local [N], offsets, rows)``: 1-D input cut into bags (some empty) over ``rows`` rows."""
    rows = draw(st.integers(1, 12))
    local = draw(st.lists(st.integers(0, rows - 1), min_size=0, max_size=40))
    cuts = sorted(draw(st.lists(st.integers(0, len(local)), min_size=1, max_size=8)))
    return torch.tensor(local, dtype=torch.int64), torch.tensor([0] + cuts[1:], dtype=torch.int64), rows


def gradients(function, weight, *args):
    weight = weight.clone().requires_grad_(True)
    output = function(weight, *args)
    output.backward(torch.linspace(-1, 1, output.numel()).reshape(output.shape))
    return output.detach(), weight.grad


@settings(max_examples=60, deadline=None)
@given(bags(), st.sampled_from(["sum", "mean"]), st.booleans(), st.booleans(), st.booleans())
def test_bag_weight_gradient_matches_torch(host, data, mode, include_last_offset, padding, weighted):
    local, offsets, rows = data
    if include_last_offset:  # the last offset ends the last bag, at the end of input (as torch documents)
        offsets = torch.cat([offsets, offsets.new_tensor([local.numel()])])
    padding_idx = 0 if padding else None
    weights = torch.rand(local.numel()) if weighted and mode == "sum" else None
    weight = torch.randn(rows, 5)

    def ours(w):
        return pooled_lookup.embedding_bag(
            LocalIds.of(local, padding_idx, rows), w, offsets, mode, weights, include_last_offset, host
        )

    def reference(w):
        return F.embedding_bag(
            local,
            w,
            offsets,
            mode=mode,
            per_sample_weights=weights,
            include_last_offset=include_last_offset,
            padding_idx=padding_idx,
        )

    output, grad = gradients(ours, weight)
    expected_output, expected_grad = gradients(reference, weight)
    assert torch.equal(output, expected_output)
    if padding_idx is not None:  # torch leaves the padding row's gradient 0; ours is never used
        grad[padding_idx] = 0
    torch.testing.assert_close(grad, expected_grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode", ["sum", "mean"])
def test_two_dimensional_bags_match_torch(host, mode):
    local, weight = torch.randint(0, 7, (6, 4)), torch.randn(7, 3)
    output, grad = gradients(
        lambda w: pooled_lookup.embedding_bag(LocalIds.of(local, None, 7), w, None, mode, None, False, host),
        weight,
    )
    expected_output, expected_grad = gradients(lambda w: F.embedding_bag(local, w, mode=mode), weight)
    assert torch.equal(output, expected_output)
    torch.testing.assert_close(grad, expected_grad)


def test_embedding_matches_torch_in_any_shape(host):
    local, weight = torch.randint(0, 9, (3, 4, 2)), torch.randn(9, 6)
    output, grad = gradients(lambda w: pooled_lookup.embedding(LocalIds.of(local, None, 9), w, host), weight)
    expected_output, expected_grad = gradients(lambda w: F.embedding(local, w), weight)
    assert torch.equal(output, expected_output) and output.shape == (3, 4, 2, 6)
    torch.testing.assert_close(grad, expected_grad)


def test_per_sample_weights_that_need_a_gradient_get_torchs_backward(host):
    local, offsets, weight = torch.tensor([0, 1, 1, 2]), torch.tensor([0, 2]), torch.randn(3, 4)
    weights = torch.rand(4, requires_grad=True)
    local_ids = LocalIds.of(local, None, 3)
    pooled_lookup.embedding_bag(local_ids, weight, offsets, "sum", weights, False, host).sum().backward()
    expected = torch.rand(4).copy_(weights.detach()).requires_grad_(True)
    F.embedding_bag(local, weight, offsets, mode="sum", per_sample_weights=expected).sum().backward()
    torch.testing.assert_close(weights.grad, expected.grad)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 6), max_size=30), st.sampled_from([None, 0, 3]))
def test_one_sort_gives_unique_counts_rows_and_the_entries_by_row(values, padding_idx):
    ids = (
        torch.tensor(values, dtype=torch.int64).reshape(-1, 1)
        if values
        else torch.zeros(0, 1, dtype=torch.int64)
    )
    padding = None if padding_idx is None else ids.reshape(-1) == padding_idx
    unique, counts, local = pooled_lookup.distinct(ids, padding)
    looked_up = ids.reshape(-1) if padding is None else ids.reshape(-1)[~padding]
    expected_unique, inverse, expected_counts = torch.unique(
        looked_up, return_inverse=True, return_counts=True
    )
    assert torch.equal(unique, expected_unique) and torch.equal(counts, expected_counts)
    assert local.rows.shape == ids.shape
    if padding is not None:
        assert local.padding_row == unique.numel() and bool(
            (local.rows.reshape(-1)[padding] == unique.numel()).all()
        )
    else:
        assert local.padding_row is None
    rows = unique.numel() + (padding is not None)
    expected = LocalIds.of(local.rows, local.padding_row, rows)
    assert torch.equal(local.order, expected.order) and torch.equal(local.starts, expected.starts)
    if padding is not None:
        assert torch.equal(local.rows.reshape(-1)[~padding], inverse)
    else:
        assert torch.equal(local.rows.reshape(-1), inverse)


@pytest.mark.parametrize("layout", ["a slice of a wider output", "expanded (a sum's gradient)", "transposed"])
def test_gradients_of_any_layout_match_torch(host, layout):
    local, offsets = torch.randint(0, 9, (40,)), torch.tensor([0, 3, 3, 17, 30])
    weights, dim = torch.randn(9, 6), 6

    def grad_of(function):
        weight = weights.clone().requires_grad_(True)
        output = function(weight)
        if layout == "a slice of a wider output":  # as a model's torch.cat([dense, pooled]) gives
            wider = torch.cat([torch.ones(output.shape[0], 3), output, torch.ones(output.shape[0], 2)], 1)
            wider.backward(torch.linspace(-1, 1, wider.numel()).reshape(wider.shape))
        elif layout == "expanded (a sum's gradient)":
            output.sum().backward()
        else:
            output.backward(torch.linspace(-1, 1, output.numel()).reshape(dim, -1).t())
        return weight.grad

    grad = grad_of(
        lambda w: pooled_lookup.embedding_bag(
            LocalIds.of(local, None, 9), w, offsets, "sum", None, False, host
        )
    )
    expected = grad_of(lambda w: F.embedding_bag(local, w, offsets, mode="sum"))
    torch.testing.assert_close(grad, expected)
