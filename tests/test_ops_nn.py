"""``fusion.nn_ops``: iota, detach, embeddings and attention, checked when added (clear
``DefinitionError``s) and evaluated against torch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fusion import DataType, DefinitionError, FusionDefinition
from fusion.testing import assert_close


def test_iota_counts_in_an_integer_type_and_refuses_floats():
    with FusionDefinition() as fd:
        x = fd.define_tensor([3], DataType.float32)
        fd.add_output(fd.ops.iota(fd, 5, "int32"))
        fd.add_output(fd.ops.add(x, fd.ops.cast(fd.ops.iota(x, 3), "float32")))
        with pytest.raises(DefinitionError, match="iota: dtype must be an integer type"):
            fd.ops.iota(fd, 4, "float32")
    count, shifted = fd.execute([torch.zeros(3)])
    assert count.dtype is torch.int32 and count.tolist() == [0, 1, 2, 3, 4]
    assert shifted.tolist() == [0.0, 1.0, 2.0]
    with pytest.raises(DefinitionError, match="the fusion definition has ended"):
        fd.ops.iota(fd, 2)


def test_embedding_looks_up_rows_and_refuses_what_is_not_a_table_lookup():
    with FusionDefinition() as fd:
        table = fd.define_tensor([6, 4], DataType.bfloat16)
        indices = fd.define_tensor([2, 3], DataType.int64)
        out = fd.ops.embedding(table, indices, padding_idx=-1)
        fd.add_output(out)
        with pytest.raises(DefinitionError, match="the table must be 2-D"):
            fd.ops.embedding(fd.ops.reshape(table, [6, 2, 2]), indices)
        with pytest.raises(DefinitionError, match="indices must be integers"):
            fd.ops.embedding(table, fd.ops.cast(indices, "float32"))
        with pytest.raises(DefinitionError, match="padding_idx 6 is not a row"):
            fd.ops.embedding(table, indices, padding_idx=6)
    weights = torch.randn(6, 4).to(torch.bfloat16)
    ids = torch.tensor([[0, 5, 2], [5, 5, 1]])
    (looked_up,) = fd.execute([weights, ids])
    assert torch.equal(looked_up, F.embedding(ids, weights))
    assert out.definition.padding_idx == 5  # -1 counted from the end


@pytest.mark.parametrize("mask", ["none", "bool", "float"])
def test_attention_matches_torch_on_three_and_four_axes(mask):
    generator = torch.Generator().manual_seed(0)
    for shape in ([3, 5, 8], [2, 3, 5, 8]):
        q, k, v = (torch.randn(shape, generator=generator) for _ in "qkv")
        allowed = torch.rand(shape[:-1] + [5], generator=generator) > 0.3
        allowed[..., 0] = True  # every query attends somewhere
        given = {"none": None, "bool": allowed,
                 "float": torch.where(allowed, 0.0, -1e4)}[mask]  # fmt: skip
        with FusionDefinition() as fd:
            tensors = [fd.define_tensor(shape, DataType.float32) for _ in "qkv"]
            if given is not None:
                tensors.append(
                    fd.define_tensor(list(given.shape), DataType.from_torch(given.dtype))
                )
            fd.add_output(fd.ops.attention(*tensors[:3], tensors[3] if given is not None else None,
                                           causal=given is None, scale=0.3))  # fmt: skip
        inputs = [q, k, v] + ([given] if given is not None else [])
        (ours,) = fd.execute(inputs)
        theirs = F.scaled_dot_product_attention(q, k, v, attn_mask=given, is_causal=given is None,
                                                scale=0.3)  # fmt: skip
        assert_close(ours, theirs, reduction_extent=5)


def test_attention_refuses_mismatched_operands():
    with FusionDefinition() as fd:
        q = fd.define_tensor([2, 4, 8], DataType.float32)
        k = fd.define_tensor([2, 6, 8], DataType.float32)
        v = fd.define_tensor([2, 6, 5], DataType.float32)
        mask = fd.define_tensor([1, 4, 6], DataType.bool_)
        out = fd.ops.attention(q, k, v, mask)  # the mask broadcasts over axis 0
        fd.add_output(out)
        with pytest.raises(DefinitionError, match="give a mask or causal=True, not both"):
            fd.ops.attention(q, k, v, mask, causal=True)
        with pytest.raises(DefinitionError, match="share a dtype"):
            fd.ops.attention(q, fd.ops.cast(k, "bfloat16"), v)
        with pytest.raises(DefinitionError, match="the key axes"):
            fd.ops.attention(q, k, fd.ops.slice(v, [0, 0, 0], [2, 5, 5]))
        with pytest.raises(DefinitionError, match="mask .* must be bool or float32"):
            fd.ops.attention(q, k, v, fd.ops.cast(mask, "int32"))
    assert out.definition.scale == pytest.approx(8**-0.5)


def test_cat_joins_along_an_axis_and_its_gradient_slices_it_back():
    from fusion.autodiff import backward
    from fusion.reference import evaluate

    with FusionDefinition() as fd:
        pieces = [fd.define_tensor([2, n], DataType.float32) for n in (3, 1, 2)]
        fd.add_output(fd.ops.mul(fd.ops.cat(pieces, -1), 2.0))
        with pytest.raises(DefinitionError, match="differ in rank or dtype"):
            fd.ops.cat([pieces[0], fd.ops.cast(pieces[1], "bfloat16")], 1)
        with pytest.raises(DefinitionError, match="extent mismatch"):
            fd.ops.cat(pieces, 0)
    values = [torch.randn(2, n) for n in (3, 1, 2)]
    (joined,) = fd.execute(values)
    assert torch.equal(joined, torch.cat(values, -1) * 2)
    seed = torch.randn(2, 6)
    grads = evaluate(backward(fd.fusion).fusion, [*values, seed])
    assert [g.tolist() for g in grads] == [(s * 2).tolist() for s in seed.split([3, 1, 2], -1)]
