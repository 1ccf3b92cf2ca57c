"""The weight average (dtrain/train/ema.py): its arithmetic, against a hand-computed
recursion, and that it leaves the trained model alone."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dtrain.train.ema import WeightAverage, ramped_decay


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.LazyLinear(2))


def test_decay_ramps_in_then_holds():
    assert ramped_decay(0.999, 1) == pytest.approx(2 / 11)
    assert ramped_decay(0.999, 90) == pytest.approx(91 / 100)
    assert ramped_decay(0.999, 10**6) == 0.999
    assert ramped_decay(0.5, 9) == 0.5  # the cap wins once the ramp (here 10/19) passes it


def test_average_follows_the_recursion_and_copies_integer_buffers():
    net = _net().eval()
    net(torch.randn(2, 3, 6, 6))  # materialise the lazy layer (eval: BatchNorm counts nothing)
    avg = WeightAverage(net, decay=0.6)
    expected = {k: v.clone() for k, v in net.state_dict().items()}
    opt = torch.optim.SGD(net.parameters(), lr=0.5)
    for n in range(1, 6):
        net.train()
        net(torch.randn(4, 3, 6, 6)).sum().backward()  # also moves BatchNorm's running stats
        opt.step()
        opt.zero_grad()
        avg.update()
        d = ramped_decay(0.6, n)
        for k, v in net.state_dict().items():
            expected[k] = d * expected[k] + (1 - d) * v if v.is_floating_point() else v.clone()
    got = avg.state_dict()
    for k, v in expected.items():
        torch.testing.assert_close(got[k], v, rtol=1e-5, atol=1e-6)
    assert got["1.num_batches_tracked"].item() == 5
    # ... and the average is not the trained weights (the check has teeth), which it left alone.
    assert not torch.allclose(got["0.weight"], net.state_dict()["0.weight"])
    assert avg.updates == 5 and not avg.module.training
    assert all(not p.requires_grad for p in avg.module.parameters())
    assert all(p.requires_grad for p in net.parameters())


def test_load_restores_weights_and_count():
    net = _net()
    net(torch.randn(2, 3, 6, 6))
    avg = WeightAverage(net, decay=0.9)
    other = {k: torch.full_like(v, 0.25) if v.is_floating_point() else v for k, v in net.state_dict().items()}
    avg.load(other, updates=7)
    assert avg.updates == 7
    assert torch.equal(avg.state_dict()["0.weight"], torch.full_like(net.state_dict()["0.weight"], 0.25))
    avg.update()  # still bound to the live model after a load
    d = ramped_decay(0.9, 8)
    torch.testing.assert_close(avg.state_dict()["0.weight"], d * 0.25 + (1 - d) * net.state_dict()["0.weight"])


def test_decay_outside_the_open_unit_interval_is_refused():
    with pytest.raises(ValueError, match=r"\(0, 1\)"):
        WeightAverage(_net(), decay=1.0)
