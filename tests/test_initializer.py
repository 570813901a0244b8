import math

import torch

from tierstore import initial_rows, initial_weights


def test_initial_row_depends_only_on_id_and_seed():
    ids = torch.tensor([5, 0, 2**62, 5, 17])
    together = initial_weights(ids, 8, seed=3, dtype=torch.float32)
    one_by_one = torch.cat([initial_weights(ids[i : i + 1], 8, 3, torch.float32) for i in range(5)])
    reversed_batch = initial_weights(ids.flip(0), 8, 3, torch.float32).flip(0)
    assert torch.equal(together, one_by_one)
    assert torch.equal(together, reversed_batch)
    assert torch.equal(together[0], together[3])


def test_seeds_and_ids_give_different_rows():
    ids = torch.arange(1000)
    a = initial_weights(ids, 16, 0, torch.float32)
    b = initial_weights(ids, 16, 1, torch.float32)
    assert not torch.equal(a, b)
    assert torch.unique(a, dim=0).shape[0] == 1000


def test_default_is_uniform_within_one_over_sqrt_dim():
    dim = 64
    weights = initial_weights(torch.arange(20000), dim, 0, torch.float64)
    bound = 1 / math.sqrt(dim)
    assert weights.abs().max() <= bound
    assert abs(weights.mean().item()) < 1e-3
    assert abs(weights.std().item() - bound / math.sqrt(3)) < 1e-3  # std of uniform(-b, b)


def test_initial_rows_have_zero_optimizer_state():
    rows = initial_rows(torch.tensor([1, 2]), dim=4, state_width=3, seed=0, dtype=torch.float32)
    assert rows.shape == (2, 7)
    assert torch.equal(rows[:, 4:], torch.zeros(2, 3))
    assert torch.equal(rows[:, :4], initial_weights(torch.tensor([1, 2]), 4, 0, torch.float32))
