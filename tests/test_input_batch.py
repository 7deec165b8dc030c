"""The model runner's step layout (worker/input_batch.py) for a hybrid model with a recurrent group
(a full-attention layer and a recurrent one): each paged group's slots come from its block table,
each sequence's state slot (its recurrent table's one entry) is in the metadata in batch order
(decodes first, then prefill chunks), and a sequence that starts at position 0 has its slot zeroed
in every recurrent layer's pool while the others' state is kept."""

import numpy as np
import torch

from roseinfer.common.kv_cache_spec import kv_cache_groups
from roseinfer.common.messages import NewRequestData
from roseinfer.layers.attention_backends import TorchAttentionBackend
from roseinfer.layers.recurrent import RecurrentStateSpec, StateTensorSpec
from roseinfer.sampling_params import SamplingParams
from roseinfer.worker.input_batch import InputBatchBuilder
from roseinfer.worker.request_state import CachedRequestState
from roseinfer.worker.state_pools import StatePools

BLOCK_SIZE = 4


def request(req_id: str, prompt_len: int, num_computed: int, blocks: list[int], slot: int) -> CachedRequestState:
    return CachedRequestState(NewRequestData(req_id, list(range(1, prompt_len + 1)), [], SamplingParams(), [],
                                             [blocks, [slot]], num_computed))


def test_state_slots_in_batch_order_and_zeroed_at_a_sequence_start():
    groups = kv_cache_groups([None, None], recurrent_layers=[1])
    device = torch.device("cpu")
    spec = RecurrentStateSpec("gated_delta_net", groups[1].layers,
                              (StateTensorSpec("conv", (2, 3)), StateTensorSpec("ssm", (4,), "float32")))
    pools = StatePools(spec, num_slots=4, dtype=torch.bfloat16, device=device)
    conv, ssm = pools.pools[1]
    assert conv.dtype == torch.bfloat16 and ssm.dtype == torch.float32 and conv.shape == (4, 2, 3)
    conv.fill_(1.0)
    ssm.fill_(1.0)
    builder = InputBatchBuilder(groups, BLOCK_SIZE, TorchAttentionBackend(device, BLOCK_SIZE), device, None, pools)
    resumed = request("resumed", 6, 5, [7, 8], slot=3)  # decodes its 6th token
    fresh = request("fresh", 6, 0, [2, 3], slot=1)  # its whole prompt: a new sequence
    inputs = builder.build([(fresh, 6), (resumed, 1)], {})
    assert inputs.meta.state_slots.tolist() == [3, 1]  # the decode first
    assert inputs.meta.slot_mapping.tolist() == [8 * BLOCK_SIZE + 1] + [2 * BLOCK_SIZE + i for i in range(4)] + [
        3 * BLOCK_SIZE, 3 * BLOCK_SIZE + 1]
    assert inputs.positions.tolist() == [5, 0, 1, 2, 3, 4, 5]
    for tensor in (conv, ssm):
        assert np.array_equal(tensor.float().flatten(1).mean(1).numpy(), [1.0, 0.0, 1.0, 1.0])
