"""Architectures: the built-ins by name (``model.architecture``), or a user's factory
(``model.module: "package.module:factory"``), each a ``Factory`` of the interface in
streamtrain/models/base.py. docs/models.md documents both, with a complete example."""

from __future__ import annotations

import importlib

import torch
from torchrec import KeyedJaggedTensor

from streamtrain.config import ConfigError, FeaturesConfig, ModelConfig, TaskConfig
from streamtrain.models import dcn_v2, deepfm, din, dlrm
from streamtrain.models.base import Factory, ModelInterfaceError, check_logits

BUILT_INS: dict[str, Factory] = {
    "dlrm": dlrm.build,
    "dcn_v2": dcn_v2.build,
    "deepfm": deepfm.build,
    "din": din.build,
}

# A user's net sits under this name in the model (and in snapshots and bases).
USER_MODULE = "module"


def factory(model: ModelConfig) -> Factory:
    """The built-in ``model.architecture``, or the function ``model.module`` names."""
    if model.module is None:
        return BUILT_INS[model.architecture]
    module_name, _, name = model.module.partition(":")
    try:
        imported = importlib.import_module(module_name)
    except ImportError as error:
        raise ConfigError(
            f"model.module: cannot import {module_name!r} ({error}); put its package on PYTHONPATH"
        ) from error
    found = getattr(imported, name, None)
    if not callable(found):
        raise ConfigError(f"model.module: {module_name} has no function {name!r}; name the factory after the colon")
    return found


def net_name(model: ModelConfig) -> str:
    return USER_MODULE if model.module is not None else model.architecture


_PROBE_ROWS = 8
_PROBE_BATCH = 3


def check_exportable(features: FeaturesConfig, model: ModelConfig, tasks: list[TaskConfig]) -> None:
    """Refuses a model that does not fit the interface, naming what is missing: its tables, logits
    of the wrong shape, a forward that does not ``torch.export``. It
    builds the model on the CPU with tables of a few rows and exports it as delivery does: seconds,
    so the worker runs it for a user's model only (each built-in's tests export it)."""
    # Imported here: delivery builds on the model, which builds on this package.
    from streamtrain.delivery.artifact import ScoringModule, export_program, unsharded_model
    from streamtrain.model import net_logits

    where = f"model.module {model.module}"
    probe = features.model_copy(
        update={"tables": [t.model_copy(update={"num_embeddings": _PROBE_ROWS}) for t in features.tables]}
    )
    click = unsharded_model(probe, model, tasks)
    keys = [t.name for t in features.tables]
    dense = torch.zeros(_PROBE_BATCH, len(features.dense))
    ids = torch.zeros(_PROBE_BATCH * len(keys), dtype=torch.int64)
    kjt = KeyedJaggedTensor(keys=keys, values=ids, lengths=torch.ones(_PROBE_BATCH * len(keys), dtype=torch.int32))
    try:
        with torch.no_grad():
            logits = net_logits(click.net, click.pairs, dense, kjt)
    except Exception as error:
        raise ModelInterfaceError(
            f"{where}: forward fails on a batch of {_PROBE_BATCH} events: {type(error).__name__}: {error}"
        ) from error
    check_logits(logits, _PROBE_BATCH, len(tasks), where)
    try:
        export_program(ScoringModule(click, keys), probe)
    except Exception as error:
        first = str(error).strip().splitlines()[0] if str(error).strip() else ""
        raise ModelInterfaceError(
            f"{where}: the model is not exportable: torch.export fails on its forward ({type(error).__name__}: "
            f"{first}); served bases are that program, so its forward must trace without data-dependent Python "
            f"control flow on tensor values"
        ) from error
