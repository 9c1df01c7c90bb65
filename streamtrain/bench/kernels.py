"""kernels: the model's own kernels against the defaults they replace, at the config's sizes, on one
CPU thread. The interaction: TorchRec's ``InteractionArch`` against ``model.FlatInteractionArch``,
forward and backward over a batch of ``batching.batch_size`` events. The sharded order: the pooled
embeddings as a sharded collection gives them (``RegroupedEmbeddings``) through the sparse arch and
the interaction, forward and backward: TorchRec's ``SparseArch``, which puts them back in the
tables' order, and ``InteractionArch``, against ``model.KeyedSparseArch`` and
``model.KeyedInteractionArch``, which pick the pairs where they are. The dense optimizer: torch's
default ``Adam`` against ``train.dense_adam`` (fused), one step over the dense layers' parameters of
the configured model. The two legs of each alternate in rounds; the ratio is the default's CPU
time over the replacement's: above 1, the replacement is faster. Both compute the same numbers
(tests/test_model.py)."""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor, KeyedTensor

from streamtrain.bench.common import machine


class RegroupedEmbeddings(EmbeddingBagCollection):
    """An EmbeddingBagCollection whose forward gives ``values`` as its pooled embeddings, keyed in
    ``order`` rather than the tables' order, as a sharded collection's come (grouped by sharding
    type and rank): what the model does after the lookup, alone."""

    def __init__(self, tables: list[EmbeddingBagConfig], order: list[str], values: torch.Tensor):
        super().__init__(tables=tables)
        self.order, self.values = order, values

    def forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        return KeyedTensor(self.order, [self.values.shape[1] // len(self.order)] * len(self.order), self.values)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--calls", type=int, default=200, help="calls per leg and round (default 200)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of both legs (default 3)")


def run(args: argparse.Namespace, progress: Callable[[str], None]) -> dict:
    from torchrec.models.dlrm import InteractionArch, SparseArch

    from streamtrain.config import load_config
    from streamtrain.model import ClickModel
    from streamtrain.models.base import embedding_configs
    from streamtrain.models.dlrm import FlatInteractionArch, KeyedInteractionArch, KeyedSparseArch
    from streamtrain.train import dense_adam

    torch.set_num_threads(1)
    config = load_config(args.config)
    calls, rounds = (5, 1) if args.quick else (args.calls, args.rounds)
    batch, features = config.batching.batch_size, len(config.features.tables)
    dim = config.features.tables[0].embedding_dim
    dense = torch.randn(batch, dim, requires_grad=True)
    sparse = torch.randn(batch, features, dim, requires_grad=True)
    upstream = torch.randn(batch, dim + features * (features + 1) // 2)

    def interaction(arch: torch.nn.Module) -> Callable[[], object]:
        return lambda: arch(dense, sparse).backward(upstream)

    tables = embedding_configs(config.features)
    names = [name for table in tables for name in table.feature_names]
    # Every other feature, then the rest: as far from the tables' order as a sharded collection's
    # (each rank's table-wise tables, then the data-parallel ones), and the same for any config.
    order = names[::2] + names[1::2]
    pooled = torch.randn(batch, len(names) * dim, requires_grad=True)

    def sharded_order(sparse_arch: type[SparseArch], inter_arch: torch.nn.Module) -> Callable[[], object]:
        module = sparse_arch(RegroupedEmbeddings(tables, order, pooled))
        return lambda: inter_arch(dense, module(None)).backward(upstream)

    model = ClickModel(config.features, config.model, config.tasks(), torch.device("cpu"))
    shapes = [p.shape for name, p in model.named_parameters() if "embedding_bags" not in name]

    def adam(make: Callable[[list[torch.Tensor]], torch.optim.Optimizer]) -> Callable[[], object]:
        params = [torch.nn.Parameter(torch.randn(shape)) for shape in shapes]
        for p in params:
            p.grad = torch.randn_like(p)
        return make(params).step

    learning_rate = config.model.dense_learning_rate
    # name -> (what one call does, {leg: (what runs, one call)})
    kernels: dict[str, tuple[str, dict[str, tuple[str, Callable[[], object]]]]] = {
        "interaction": (
            f"forward and backward, {batch:,} events, {features} features of dim {dim}",
            {
                "default": ("torchrec InteractionArch", interaction(InteractionArch(features))),
                "ours": ("FlatInteractionArch", interaction(FlatInteractionArch(features))),
            },
        ),
        "sharded_order": (
            f"sparse arch and interaction, forward and backward, {batch:,} events, {len(names)} features of dim "
            f"{dim}, from a sharded order",
            {
                "default": (
                    "torchrec SparseArch, InteractionArch",
                    sharded_order(SparseArch, InteractionArch(len(names))),
                ),
                "ours": (
                    "KeyedSparseArch, KeyedInteractionArch",
                    sharded_order(KeyedSparseArch, KeyedInteractionArch(names)),
                ),
            },
        ),
        "dense_adam": (
            f"one step over {len(shapes)} tensors, {sum(s.numel() for s in shapes):,} values",
            {
                "default": ("torch.optim.Adam", adam(lambda params: torch.optim.Adam(params, lr=learning_rate))),
                "ours": ("dense_adam (fused)", adam(lambda params: dense_adam(params, learning_rate))),
            },
        ),
    }
    progress(f"{rounds} round(s) of {calls} calls per leg, after a warm-up round")
    results = {}
    for name, (what, legs) in kernels.items():
        seconds = dict.fromkeys(legs, 0.0)
        for round_ in range(rounds + 1):  # round 0 warms up
            for leg, (_runs, call) in legs.items():
                started = time.thread_time()
                for _ in range(calls):
                    call()
                if round_:
                    seconds[leg] += time.thread_time() - started
        per_call = {leg: s / (calls * rounds) * 1e6 for leg, s in seconds.items()}
        results[name] = {
            "what": what,
            "default": legs["default"][0],
            "ours": legs["ours"][0],
            "default_us": per_call["default"],
            "ours_us": per_call["ours"],
            "ratio": per_call["default"] / per_call["ours"],
        }
        progress(f"  {name}: {per_call['default']:,.0f} µs against {per_call['ours']:,.0f} µs")
    return {
        "benchmark": "kernels",
        "machine": machine(),
        "config": str(args.config),
        "calls": calls,
        "rounds": rounds,
        "kernels": results,
    }


def table(result: dict) -> str:
    lines = [
        f"  one CPU thread, {result['rounds']} round(s) of {result['calls']} calls per leg; CPU time per call",
        f"  {'kernel':<14} {'default':>47} {'ours':>47} {'ratio':>7}",
    ]
    for name, k in result["kernels"].items():
        lines.append(
            f"  {name:<14} {k['default']:>36} {k['default_us']:>7,.0f} µs {k['ours']:>36} {k['ours_us']:>7,.0f} µs "
            f"{k['ratio']:>7.2f}"
        )
        lines.append(f"  {'':<14} {k['what']}")
    return "\n".join(lines)


def markdown(result: dict) -> str:
    lines = [
        f"One CPU thread, {result['rounds']} rounds of {result['calls']} calls per leg; CPU time per call.\n",
        "| kernel | default | ours | ratio |",
        "|---|---|---|---|",
    ]
    for name, k in result["kernels"].items():
        lines.append(
            f"| {name}: {k['what']} | {k['default']}: {k['default_us']:,.0f} µs | {k['ours']}: {k['ours_us']:,.0f} µs "
            f"| **{k['ratio']:.2f}** |"
        )
    return "\n".join(lines)
