"""PyTorch's device-generic stream and event API (``torch.Stream``, ``torch.Event``,
``torch.accelerator``) on dipu, as torchft and other libraries call it: a device without an
index means the current device, as for CUDA."""
import pytest
import torch

import ditorch  # noqa: F401


@pytest.mark.parametrize("index", [0, pytest.param(1, marks=pytest.mark.two_devices)])
def test_a_stream_on_dipu_without_an_index_is_on_the_current_device(index):
    torch.dipu.set_device(index)
    stream = torch.Stream(torch.device("dipu"))
    assert stream.device == torch.device("dipu", index)
    assert torch.accelerator.current_stream().device_index == index
    x = torch.arange(1000.0, device="dipu")
    with stream:
        y = x * 2
    event = torch.Event(device=torch.device("dipu"))
    event.record(stream)
    event.synchronize()
    assert event.query()
    torch.accelerator.synchronize(torch.device("dipu"))
    assert torch.equal(y.cpu(), torch.arange(1000.0) * 2)
