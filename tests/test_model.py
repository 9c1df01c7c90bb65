"""What is trained: the interaction and the dense optimizer compute what TorchRec's and torch's
defaults compute, bit for bit or to rounding, so a faster kernel never changes a model."""

import pytest
import torch
from torchrec import EmbeddingBagConfig
from torchrec.models.dlrm import InteractionArch, SparseArch

from streamtrain.bench.kernels import RegroupedEmbeddings
from streamtrain.models.dlrm import FlatInteractionArch, KeyedInteractionArch, KeyedSparseArch
from streamtrain.train import dense_adam


@pytest.mark.parametrize("features", [0, 1, 16])
def test_flat_interaction_equals_torchrecs_forward_and_backward(features):
    torch.manual_seed(features)
    batch, dim = 64, 8
    dense = torch.randn(batch, dim, dtype=torch.float64, requires_grad=True)
    sparse = torch.randn(batch, features, dim, dtype=torch.float64, requires_grad=True)
    upstream = torch.randn(batch, dim + features + features * (features - 1) // 2, dtype=torch.float64)
    gradients = []
    for arch in (InteractionArch(features), FlatInteractionArch(features)):
        out = arch(dense, sparse)
        out.backward(upstream)
        gradients.append((out.detach(), dense.grad.clone(), None if sparse.grad is None else sparse.grad.clone()))
        dense.grad = sparse.grad = None
    (ours, ours_dense, ours_sparse), (theirs, theirs_dense, theirs_sparse) = gradients[1], gradients[0]
    assert torch.equal(ours, theirs)
    assert torch.equal(ours_dense, theirs_dense)
    if features == 0:
        assert ours_sparse is None and theirs_sparse is None
    else:
        # to rounding: each feature's gradient is a sum over the others, and the batched matmul
        # orders that sum per CPU (bit-equal on the Intel hosts, 1e-13 apart on an AMD one)
        torch.testing.assert_close(ours_sparse, theirs_sparse, rtol=1e-12, atol=1e-14)


def test_flat_interaction_keeps_the_state_dict_torchrecs_has():
    assert FlatInteractionArch(16).state_dict().keys() == InteractionArch(16).state_dict().keys()


def test_keyed_archs_compute_torchrecs_numbers_from_a_sharded_order_and_the_tables_order():
    """The forward bit for bit; the backward bit for bit in the tables' order and to rounding in a
    sharded one, which sums each feature's gradient over the others in another order."""
    torch.manual_seed(0)
    batch, dim = 32, 4
    tables = [
        EmbeddingBagConfig(name=f"t{i}", feature_names=[f"f{i}"], num_embeddings=9, embedding_dim=dim) for i in range(5)
    ]
    tables[1].feature_names.append("shares_t1")
    names = [name for table in tables for name in table.feature_names]
    dense = torch.randn(batch, dim, dtype=torch.float64, requires_grad=True)
    upstream = torch.randn(batch, dim + len(names) * (len(names) + 1) // 2, dtype=torch.float64)
    for order in (["f3", "f0", "shares_t1", "f4", "f1", "f2"], names):
        pooled = torch.randn(batch, len(names) * dim, dtype=torch.float64, requires_grad=True)
        results = []
        for sparse_arch, inter_arch in (
            (SparseArch, InteractionArch(len(names))),
            (KeyedSparseArch, KeyedInteractionArch(names)),
        ):
            out = inter_arch(dense, sparse_arch(RegroupedEmbeddings(tables, order, pooled))(None))
            out.backward(upstream)
            results.append((out.detach(), dense.grad.clone(), pooled.grad.clone()))
            dense.grad = pooled.grad = None
        (theirs, *their_grads), (ours, *our_grads) = results
        assert torch.equal(ours, theirs), order
        for our_grad, their_grad in zip(our_grads, their_grads, strict=True):
            if order == names:  # the tables' order: the backward too, bit for bit
                assert torch.equal(our_grad, their_grad)
            else:
                torch.testing.assert_close(
                    our_grad, their_grad, rtol=1e-12, atol=1e-12, msg=lambda m, o=order: f"{o}: {m}"
                )


def test_dense_adam_takes_the_steps_and_keeps_the_state_of_torchs_default():
    torch.manual_seed(0)
    shapes = [(64, 152), (64,), (1, 32), (100, 16)]
    ours = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    optimizers = dense_adam(ours, 0.01), torch.optim.Adam(theirs, lr=0.01)
    for _ in range(5):
        for a, b in zip(ours, theirs, strict=True):
            a.grad = torch.randn_like(a)
            b.grad = a.grad.clone()
        for optimizer in optimizers:
            optimizer.step()
    assert all(torch.allclose(a, b, rtol=1e-6, atol=1e-7) for a, b in zip(ours, theirs, strict=True))
    ours_state, theirs_state = (o.state_dict()["state"] for o in optimizers)
    assert {k: set(v) for k, v in ours_state.items()} == {k: set(v) for k, v in theirs_state.items()}
