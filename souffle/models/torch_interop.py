"""Loading Souffle's numpy weights into the PyTorch reference modules."""

from __future__ import annotations

from typing import Mapping

import numpy as np


def load_weights(module, weights: Mapping[str, object], ignored_suffixes: tuple[str, ...] = ()):
    """Load ``weights`` strictly into ``module``; its own buffers named by ``ignored_suffixes``
    (e.g. ``num_batches_tracked``) are kept, since they are not model weights."""
    import torch

    state = {k: v for k, v in module.state_dict().items() if ignored_suffixes and k.endswith(ignored_suffixes)}
    state.update({k: torch.tensor(np.asarray(v)) for k, v in weights.items()})  # a copy: graph weights are read-only
    module.load_state_dict(state, strict=True)
    return module.eval()
