"""DeepFM (Guo et al., IJCAI 2017): TorchRec's ``SimpleDeepFMNN``. A factorization machine and a
deep layer (``model.deepfm.deep_dimension`` wide) over the dense vector and the pooled embeddings,
read beside the dense vector by the heads of ``model.multitask`` in its over arch's place. Its dense
arch is DLRM's (``model.dense_arch_layer_sizes``), so every built-in reads that setting alike."""

from __future__ import annotations

from torch import nn
from torchrec.models.deepfm import SimpleDeepFMNN
from torchrec.models.dlrm import DenseArch

from streamtrain.heads import HEADS
from streamtrain.models.base import ModelSpec


def build(spec: ModelSpec) -> nn.Module:
    dim = spec.features.tables[0].embedding_dim
    deep = spec.model.deepfm.deep_dimension
    net = SimpleDeepFMNN(
        num_dense_features=spec.dense_in_features,
        embedding_bag_collection=spec.embedding_bag_collection(),
        hidden_layer_size=spec.model.dense_arch_layer_sizes[0],
        deep_fm_dimension=deep,
    )
    net.dense_arch = DenseArch(spec.dense_in_features, list(spec.model.dense_arch_layer_sizes), spec.dense_device)
    # The over arch's input: the dense vector, the deep layer and the FM's one value.
    net.over_arch = HEADS[spec.model.multitask](dim + deep + 1, spec.tasks, spec.model, spec.dense_device)
    return net
