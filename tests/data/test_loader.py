"""TokenDataLoader: the cursor contract (B*T+1 reads, shift, lookahead), end of data, rewind,
state_dict round trip, rank slicing, and refusal of foreign states."""

from __future__ import annotations

import json

import pytest
import torch

from kimik3.config.schema import DataConfig
from kimik3.data import DataError, EndOfData, ShardedTokenDataset, TokenDataLoader, prepare_data

B, T = 2, 8


@pytest.fixture
def train(prepared):
    return ShardedTokenDataset(prepared, "train")


def _stream(ds):
    return torch.from_numpy(ds.read(0, ds.num_tokens))


def test_batch_is_b_t_plus_one_contiguous_tokens_shifted_by_one(train):
    stream = _stream(train)
    loader = TokenDataLoader(train, B, T)
    x, y = loader.next_batch()
    assert x.shape == y.shape == (B, T) and x.dtype == y.dtype == torch.int64
    assert torch.equal(x.flatten(), stream[: B * T]) and torch.equal(y.flatten(), stream[1 : B * T + 1])
    assert loader.position == B * T
    x2, _ = loader.next_batch()
    assert torch.equal(x2.flatten(), stream[B * T : 2 * B * T])
    assert x2[0, 0] == y[-1, -1]  # the lookahead token is the next batch's first input


def test_end_of_data_without_wrap_then_rewind_starts_epoch_one(train):
    loader = TokenDataLoader(train, B, T)
    first = loader.next_batch()
    batches = 1
    while True:
        try:
            loader.next_batch()
        except EndOfData as e:
            assert "train split ends" in str(e)
            break
        batches += 1
    assert batches == (train.num_tokens - 1) // (B * T)
    stuck = loader.position
    with pytest.raises(EndOfData):
        loader.next_batch()
    assert loader.position == stuck and loader.epoch == 0
    loader.rewind()
    assert (loader.epoch, loader.position) == (1, 0)
    again = loader.next_batch()
    assert torch.equal(again[0], first[0]) and torch.equal(again[1], first[1])


def test_state_dict_round_trip_resumes_the_exact_next_batch(train):
    loader = TokenDataLoader(train, B, T)
    for _ in range(3):
        loader.next_batch()
    loader.rewind()
    loader.next_batch()
    state = json.loads(json.dumps(loader.state_dict()))  # plain JSON-able values
    expected = loader.next_batch()
    resumed = TokenDataLoader(train, B, T)
    resumed.load_state_dict(state)
    assert (resumed.epoch, resumed.position) == (1, B * T)
    got = resumed.next_batch()
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])


def test_two_ranks_concatenate_to_the_single_rank_batch_of_twice_the_size(train):
    """Rank r reads [pos + r*B*T, pos + (r+1)*B*T + 1): cat(rank0, rank1) along dim 0 equals
    one world_size=1 loader with batch 2B, batch after batch; all cursors advance by 2*B*T."""
    single = TokenDataLoader(train, 2 * B, T)
    ranks = [TokenDataLoader(train, B, T, rank=r, world_size=2) for r in range(2)]
    for _ in range(3):
        xs, ys = single.next_batch()
        parts = [loader.next_batch() for loader in ranks]
        assert torch.equal(torch.cat([p[0] for p in parts]), xs)
        assert torch.equal(torch.cat([p[1] for p in parts]), ys)
        assert ranks[0].position == ranks[1].position == single.position


def test_foreign_states_are_refused(prepared, train, tmp_path, write_text):
    state = TokenDataLoader(train, B, T).state_dict()
    with pytest.raises(DataError, match="batch_size is 2 in the state but 4 here"):
        TokenDataLoader(train, 4, T).load_state_dict(state)
    with pytest.raises(DataError, match="seq_len is 8 in the state but 4 here"):
        TokenDataLoader(train, B, 4).load_state_dict(state)
    with pytest.raises(DataError, match="world_size is 1 in the state but 2 here"):
        TokenDataLoader(train, B, T, world_size=2).load_state_dict(state)
    with pytest.raises(DataError, match="split is 'train' in the state but 'val' here"):
        TokenDataLoader(ShardedTokenDataset(prepared, "val"), B, T).load_state_dict(state)
    other_src = write_text(tmp_path / "other.txt", "different text " * 100)
    other = prepare_data(DataConfig(source=str(other_src), prepared_dir=str(tmp_path / "other")), progress=False)
    with pytest.raises(DataError, match=r"dataset is 'corpus.txt/byte-257' .* in the state but 'other.txt/byte-257'"):
        TokenDataLoader(ShardedTokenDataset(other, "train"), B, T).load_state_dict(state)
    with pytest.raises(DataError, match="position=3, epoch=0: not a cursor of this loader"):
        TokenDataLoader(train, B, T).load_state_dict({**state, "position": 3})


def test_bad_geometry_is_refused_up_front(train):
    with pytest.raises(DataError, match=r"fewer than one batch needs \(world_size\*batch_size\*seq_len\+1 = 1\*64\*64\+1"):
        TokenDataLoader(train, 64, 64)
    with pytest.raises(DataError, match="rank=2 must be in"):
        TokenDataLoader(train, B, T, rank=2, world_size=2)
    with pytest.raises(DataError, match="must both be >= 1"):
        TokenDataLoader(train, 0, T)
