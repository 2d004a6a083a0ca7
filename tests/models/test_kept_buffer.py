"""KeptBuffer: views of one flat allocation, grown only when a request does not fit."""

import torch

from ragen.models.kept_buffer import KeptBuffer


def test_views_share_the_buffer_until_a_request_outgrows_it():
    kept = KeptBuffer()
    first = kept.view((2, 3), torch.float32)
    assert kept.buffer.numel() == 6
    smaller = kept.view((5,), torch.float32)
    assert smaller.data_ptr() == first.data_ptr() and smaller.shape == (5,)
    grown = kept.view((4, 4), torch.float32, spare=1.5)  # grows to 1.5 times the request
    assert kept.buffer.numel() == 24 and grown.shape == (4, 4)
    again = kept.view((4, 5), torch.float32, spare=1.5)  # fits in the spare room: same pages
    assert again.data_ptr() == grown.data_ptr() and kept.buffer.numel() == 24
    other = kept.view((2,), torch.bfloat16)  # another dtype: a new buffer of exactly the request
    assert other.dtype == torch.bfloat16 and kept.buffer.numel() == 2
