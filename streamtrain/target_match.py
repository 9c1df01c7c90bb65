"""Target matches (``model.target_matches``): how many of a history feature's ids equal the candidate's.

A user's recent categories matter most where they hold the ad's own category. DLRM sees the two
features only as pooled embeddings and their dot product, where a match is one term among the
history's others, and a model learns each category's match one pair of rows at a time (docs/benchmarks.md,
``bench quality`` found 0.27 of the planted effect learnt). Target attention (DIN) scores every
history id against the candidate instead; this is its exact-match kernel: per pair of features,
the count of history ids equal to the candidate's, read from the batch's ids, with no parameters.
The counts join the dense features ahead of the model (streamtrain/model.py), whatever its
architecture, so every task's head can use them, and a rare category's match counts as much as a
frequent one's.

Both features must map raw ids to rows the same way (config.py checks it), or equal rows would not
mean equal ids.
"""

from __future__ import annotations

import torch
from torchrec.models.dlrm import DLRM
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor

from streamtrain.config import TargetMatchConfig

# Never a row: ids are rows >= 0, and the two paddings differ so that padding never matches padding.
_CANDIDATE_PADDING, _HISTORY_PADDING = -1, -2


def match_counts(sparse: KeyedJaggedTensor, pairs: list[tuple[str, str]]) -> torch.Tensor:
    """[B, len(pairs)] int64: per event and (candidate, history) pair of features, how many of the
    (candidate id, history id) pairs are equal."""
    if sparse.stride() == 0:  # an empty batch (a lockstep filler), which KJT.to_dict cannot split
        return torch.zeros((0, len(pairs)), dtype=torch.int64, device=sparse.values().device)
    features = sparse.to_dict()
    columns = []
    for candidate_key, history_key in pairs:
        candidate = _padded(features[candidate_key], _CANDIDATE_PADDING)  # [B, Lc]
        history = _padded(features[history_key], _HISTORY_PADDING)  # [B, Lh]
        columns.append((candidate.unsqueeze(2) == history.unsqueeze(1)).sum(dim=(1, 2)))
    return torch.stack(columns, dim=1)


def _padded(ids: JaggedTensor, padding: int) -> torch.Tensor:
    """``JaggedTensor.to_padded_dense`` as torchrec 1.8 does it: torchrec 1.6 takes ``int()`` of
    the longest length, which ``torch.export`` (torch 2.11) refuses as a guard on data; the
    ``.item()`` alone is an int in eager and a symbol under export."""
    longest = ids.lengths().max().item()
    return torch.ops.fbgemm.jagged_to_padded_dense(ids.values(), [ids.offsets()], [longest], padding)


class TargetMatchDLRM(DLRM):
    """DLRM whose dense arch also reads the match counts after the dense features (the model
    appends them). A subclass, so that the parameter names (and a snapshot's, a served base's)
    stay DLRM's."""

    def __init__(
        self,
        matches: list[TargetMatchConfig],
        embedding_bag_collection: EmbeddingBagCollection,
        dense_in_features: int,
        dense_arch_layer_sizes: list[int],
        over_arch_layer_sizes: list[int],
        dense_device: torch.device,
    ):
        super().__init__(
            embedding_bag_collection=embedding_bag_collection,
            dense_in_features=dense_in_features + len(matches),
            dense_arch_layer_sizes=dense_arch_layer_sizes,
            over_arch_layer_sizes=over_arch_layer_sizes,
            dense_device=dense_device,
        )
