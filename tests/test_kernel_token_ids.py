"""The token-id range kernel under the interpreter, against its reference and a hand-made case."""

import pytest
import torch
from hypothesis import given, settings, strategies as st

from metainfer.kernels import KernelInputError
from metainfer.kernels import token_ids as T
from metainfer.kernels.configs import config_for


@settings(max_examples=25, deadline=None)
@given(shape=st.lists(st.integers(1, 40), min_size=1, max_size=3), vocab=st.integers(1, 300),
       bad=st.lists(st.tuples(st.integers(0, 10**6), st.sampled_from([-1, -7, 0, 1, 5000])), max_size=4),
       dtype=st.sampled_from([torch.int64, torch.int32]), transposed=st.booleans())
def test_against_reference(shape, vocab, bad, dtype, transposed, interpret):
    ids = torch.randint(0, vocab, shape, dtype=dtype)
    flat = ids.view(-1)
    for pos, offset in bad:  # offset 0 or 1 from the vocabulary's end, or negative, or far out
        flat[pos % flat.numel()] = vocab - 1 + offset if offset >= 0 else offset
    if transposed and ids.dim() > 1:
        ids = ids.transpose(0, -1)  # a non-contiguous input
    safe, first = T.launch(ids, vocab, config=config_for("token_ids", ids.device))
    ref_safe, ref_first = T.reference(ids, vocab)
    assert safe.shape == ids.shape and safe.dtype == ids.dtype
    assert torch.equal(safe, ref_safe) and torch.equal(first, ref_first)


def test_a_hand_made_case(interpret):
    ids = torch.tensor([[3, 9, 10, -1], [0, 12, 2, 1]])
    safe, first = T.launch(ids, 10, config=config_for("token_ids", ids.device))
    assert safe.tolist() == [[3, 9, 0, 0], [0, 0, 2, 1]]
    assert first.tolist() == [2]  # flat position of the first id outside 0..9
    clean, none = T.launch(torch.tensor([0, 9]), 10, config=config_for("token_ids", ids.device))
    assert clean.tolist() == [0, 9] and none.tolist() == [2]  # n: no bad id


def test_bad_launches_are_named():
    with pytest.raises(KernelInputError, match="dtype torch.float32"):
        T.launch(torch.zeros(3), 10, config={"BLOCK": 16})
    with pytest.raises(KernelInputError, match="vocab must be a positive int"):
        T.launch(torch.zeros(3, dtype=torch.long), 0, config={"BLOCK": 16})
