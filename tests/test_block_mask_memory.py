"""Under block_mask packing a probe's batches keep no dense [1, 1, T, T] mask (issue 34: 1 GiB a batch at
8 x 2048 tokens, for every batch a probe cycles through); the mask is built from the position_ids when a
batch's inputs are taken, in the dtype the model gets. Real tensors, the synthetic stream of tiny-llama."""

import torch

from nandoctor.config import set_field
from nandoctor.data import stream
from nandoctor.models import model_config
from nandoctor.recipes import recipe_by_name
from nandoctor.userdata.collate import block_mask


def packed_stream(packing: str):
    recipe = set_field(set_field(recipe_by_name("tiny-llama"), "data.packing", packing), "seq_len", 256)
    return stream(recipe, model_config(recipe), seed=0)


def kept_bytes(batches) -> int:
    return sum(t.numel() * t.element_size() for b in batches for t in b.tensors.values())


def test_block_mask_batches_keep_no_dense_mask_and_build_the_same_one_when_asked():
    batches = packed_stream("block_mask").batches
    tokens = batches[0].tensors["input_ids"].shape[1]
    assert "attention_mask" not in batches[0].tensors
    assert kept_bytes(batches) < tokens * tokens  # one fp32 mask is 4 x tokens^2
    mask = batches[0].inputs["attention_mask"]
    assert mask.shape == (1, 1, tokens, tokens) and mask.dtype == torch.float32
    assert torch.equal(mask, block_mask(batches[0].tensors["position_ids"][0]))
    half = batches[0].to("cpu", torch.bfloat16)["attention_mask"]
    assert half.dtype == torch.bfloat16 and half.min().item() == torch.finfo(torch.bfloat16).min


def test_other_packings_keep_their_inputs_as_collated():
    for packing in ("none", "position_ids", "position_ids_with_mask"):
        batch = packed_stream(packing).batches[0]
        assert batch.inputs.keys() == batch.tensors.keys()
