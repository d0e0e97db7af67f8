"""What the profilers do with a block's inputs and state: ``measure_chain`` leaves the caller's
``sample_input`` as it was even when the first block writes its input in place, and a block
holding a tensor as a plain attribute (not a buffer) fails with the block named and the fix."""
import pytest
import torch
import torch.nn as nn

from scheduler.profile import measure_chain, meta_chain


class Normalize(nn.Module):
    """Normalizes its input in place (an image pipeline's first step)."""

    def forward(self, x):
        return x.sub_(0.5).div_(2.0)


@pytest.mark.parametrize("sample", [torch.ones(2, 8), torch.ones(4, 8)[::2]])
def test_measure_chain_leaves_sample_input_alone(sample):
    before = sample.clone()
    chain = measure_chain([Normalize(), nn.Linear(8, 8), nn.Linear(8, 4)], sample,
                          input_grad=False, repeat=2, warmup=1)
    assert torch.equal(sample, before)  # was 1.0 -> -0.4998 after the runs
    # the sizes are still the caller's tensor's (a strided view counts its whole storage)
    assert chain.x[0] == sample.untyped_storage().nbytes()


class Masked(nn.Module):
    def __init__(self, T, D):
        super().__init__()
        self.l = nn.Linear(D, D)
        self.mask = torch.ones(T, T).tril().bool()  # a plain attribute: not a buffer

    def forward(self, x):
        w = x @ x.transpose(-1, -2)
        return torch.softmax(w.masked_fill(~self.mask, float("-inf")), -1) @ self.l(x)


def test_plain_tensor_attribute_is_named_in_meta_chain_errors():
    with pytest.raises(RuntimeError, match=r"model_blocks\[1\] \(Masked\): .*device.*"
                                           r"register_buffer"):
        meta_chain([nn.Linear(16, 16), Masked(8, 16), nn.Linear(16, 4)], (2, 8, 16))


def test_registered_buffer_works_in_meta_chain():
    m = Masked(8, 16)
    mask = m.mask
    del m.mask
    m.register_buffer("mask", mask, persistent=False)
    chain = meta_chain([nn.Linear(16, 16), m, nn.Linear(16, 4)], (2, 8, 16))
    assert chain.L == 3
