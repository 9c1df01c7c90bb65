"""Architectures: the built-ins by name (``model.architecture``), or a user's factory
(``model.module: "package.module:factory"``), each a ``Factory`` of the interface in
streamtrain/models/base.py. docs/models.md documents both, with a complete example."""

from __future__ import annotations

import importlib

from streamtrain.config import ConfigError, ModelConfig
from streamtrain.models import dcn_v2, deepfm, din, dlrm
from streamtrain.models.base import Factory

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
