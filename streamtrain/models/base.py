"""The model interface: what the worker trains, whichever architecture it is.

A model is an ``nn.Module`` made by a factory from a ``ModelSpec``::

    forward(dense: Tensor [B, spec.dense_in_features] float32, sparse: KeyedJaggedTensor) -> Tensor [B, tasks]

- ``dense`` is the decoder's dense features (transformed), then one column per target match (the
  count of the history's ids equal to the candidate's, streamtrain/target_match.py); ``sparse``
  holds one key per entry of ``features.tables``, in that order, its values int64 row ids (the id
  mapping applied); the output is a logit per task, in ``spec.tasks``' order (no sigmoid: the loss
  and the server add it).
- Its tables are TorchRec ``EmbeddingBagCollection``s (pooled) or ``EmbeddingCollection``s (an
  embedding per id, for a sequence feature) built on ``spec.table_device`` from ``spec.tables()``
  (the meta device while the planner shards them; fbgemm's fused optimizer then updates them in the
  backward), each table in one collection; several collections may read the same ``sparse``, each
  its own keys. A collection's output is read by key (``KeyedTensor.regroup``, ``kt[name]``): a
  sharded one orders it by shard. Dims may differ from table to table; fbgemm's fused kernel needs
  each to be a multiple of 4. Every parameter outside the collections is dense: replicated, updated
  by Adam, and published whole in each delta. ``table_weights`` finds the tables, so export and
  deltas need nothing more from the module.
- Its forward must ``torch.export`` with a dynamic batch (the served base is that program), and
  ``torch.fx``-trace as far as its collections' inputs (TorchRec's train pipeline finds them so).
  It must also take an empty batch: a rank with no events trains one (sum, never average, over
  the batch). streamtrain.delivery.artifact.check_exportable tries the export and the shape at the
  worker's start-up.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass

import torch
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingCollection, EmbeddingConfig, PoolingType

from streamtrain.config import ConfigError, FeaturesConfig, ModelConfig, TaskConfig

_POOLING = {"sum": PoolingType.SUM, "mean": PoolingType.MEAN}


@dataclass(frozen=True)
class ModelSpec:
    """What a factory builds from: the validated features, model settings and tasks, and where
    to put the dense layers and the tables. A factory may be called several times (to plan, to
    train, by the start-up check with tables of a few rows, by each export): it must build the same
    module from the same spec, its sizes read from the spec, never written in.

    - ``features``: the ``features`` section: ``tables`` in the order ``sparse`` keys them (each
      with ``name``, ``embedding_dim``, ``num_embeddings``, ``pooling``, ``shares_table_with``),
      and ``dense`` in the order of ``dense``'s first columns.
    - ``model``: the ``model`` section; ``options`` holds ``model.options``, the factory's own
      settings, and ``target_matches`` the pairs whose counts follow the dense features.
    - ``tasks``: the tasks, one logit column each, in this order.
    - ``dense_device``: where the dense layers go; layers built without a device land there too.
    - ``table_device``: where the collections go: the meta device while the planner shards them,
      the CPU for an export.
    """

    features: FeaturesConfig
    model: ModelConfig
    tasks: list[TaskConfig]
    dense_device: torch.device
    table_device: torch.device

    @property
    def dense_in_features(self) -> int:
        """The width of ``dense``: the dense features, then one match count per target match."""
        return len(self.features.dense) + len(self.model.target_matches)

    def tables(self, exclude: Collection[str] = ()) -> list[EmbeddingBagConfig]:
        """A table per entry that owns one (but those named in ``exclude``), looked up by its own
        feature and by those sharing it."""
        return [t for t in embedding_configs(self.features) if t.name not in exclude]

    def embedding_bag_collection(self, exclude: Collection[str] = ()) -> EmbeddingBagCollection:
        """The tables, pooled per event (but those named in ``exclude``)."""
        return EmbeddingBagCollection(tables=self.tables(exclude), device=self.table_device)

    def embedding_collection(self, tables: Collection[str]) -> EmbeddingCollection:
        """The tables named, unpooled: an embedding per id (a sequence feature's)."""
        return EmbeddingCollection(
            tables=[
                EmbeddingConfig(
                    name=t.name,
                    feature_names=t.feature_names,
                    num_embeddings=t.num_embeddings,
                    embedding_dim=t.embedding_dim,
                )
                for t in embedding_configs(self.features)
                if t.name in tables
            ],
            device=self.table_device,
        )


Factory = Callable[[ModelSpec], nn.Module]


def embedding_configs(features: FeaturesConfig) -> list[EmbeddingBagConfig]:
    return [
        EmbeddingBagConfig(
            name=t.name,
            feature_names=[t.name, *(f.name for f in features.tables if f.shares_table_with == t.name)],
            num_embeddings=t.num_embeddings,
            embedding_dim=t.embedding_dim,
            pooling=_POOLING[t.pooling],
        )
        for t in features.owned_tables()
    ]


# Where each kind of collection keeps its tables, by table name.
TABLE_ATTRIBUTES = ("embedding_bags", "embeddings")


def table_weights(module: nn.Module) -> dict[str, str]:
    """Each table's weight, by table name: its parameter's name in ``module``'s state dict."""
    weights: dict[str, str] = {}
    for path, collection in module.named_modules():
        prefix = f"{path}." if path else ""
        if isinstance(collection, EmbeddingBagCollection):
            configs, kind = collection.embedding_bag_configs(), TABLE_ATTRIBUTES[0]
        elif isinstance(collection, EmbeddingCollection):
            configs, kind = collection.embedding_configs(), TABLE_ATTRIBUTES[1]
        else:
            continue
        weights |= {c.name: f"{prefix}{kind}.{c.name}.weight" for c in configs}
    return weights


class ModelInterfaceError(ConfigError):
    """A model that breaks the interface; the message says what is missing."""


def check_tables(module: nn.Module, features: FeaturesConfig, where: str) -> None:
    """Refuses ``module`` unless every table of ``features`` is in one of its collections."""
    found = table_weights(module)
    missing = [t.name for t in features.owned_tables() if t.name not in found]
    if missing:
        raise ModelInterfaceError(
            f"{where}: the model has no tables for {missing} (found {sorted(found) or 'no tables'}); build them "
            f"in an EmbeddingBagCollection from spec.tables() on spec.table_device (spec.embedding_bag_collection()), "
            f"or unpooled in spec.embedding_collection(names)"
        )


def check_logits(logits: object, batch: int, tasks: int, where: str) -> None:
    """Refuses a forward's output unless it is [batch, tasks]."""
    shape = tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__
    if shape != (batch, tasks):
        raise ModelInterfaceError(
            f"{where}: forward returned {shape} for a batch of {batch} events and {tasks} task(s); it must return "
            f"logits [batch, tasks] = ({batch}, {tasks}), one column per task in model.tasks' order"
        )
