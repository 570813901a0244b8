"""Shared test helpers: the dict oracle's view of a row nobody has written."""

import torch

from tierstore import initial_weights


def initial(id_, dim, seed=0):
    return initial_weights(torch.tensor([id_]), dim, seed, torch.float32)[0]
