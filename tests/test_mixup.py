"""Mixup (TrainConfig.mixup_alpha): seeded draws, the blend and its loss (resume: tests/test_train_ddp.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dtrain.train import mixup as M


def test_draws_are_a_function_of_seed_rank_step_and_micro_step():
    lam, perm = M.draw(0.2, 16, seed=3, rank=0, step=7, micro=0)
    again = M.draw(0.2, 16, seed=3, rank=0, step=7, micro=0)
    assert lam == again[0] and torch.equal(perm, again[1])
    assert sorted(perm.tolist()) == list(range(16))
    others = [M.draw(0.2, 16, 3, 1, 7, 0), M.draw(0.2, 16, 3, 0, 8, 0), M.draw(0.2, 16, 3, 0, 7, 1), M.draw(0.2, 16, 4, 0, 7, 0)]
    assert all(o[0] != lam for o in others)  # another rank, step, micro-step or seed: another blend
    assert M.draw(0.2, 16, -1, 0, 7, 0)[0] != M.draw(0.2, 16, 1, 0, 7, 0)[0]  # a negative seed is a seed too
    lams = [M.draw(0.2, 4, 0, 0, s, 0)[0] for s in range(400)]
    assert min(lams) >= 0.5 and max(lams) <= 1.0
    # Beta(0.2, 0.2) folded to [0.5, 1]: most blends stay near one image, some are near half and half.
    assert sum(v > 0.9 for v in lams) > 200 and sum(v < 0.7 for v in lams) > 20


def test_the_blend_is_convex_and_the_loss_is_cross_entropy_on_the_blended_target():
    torch.manual_seed(0)
    images = torch.randn(6, 3, 8, 8)
    lam, perm = 0.7, torch.tensor([1, 2, 3, 4, 5, 0])
    mixed = M.mix(images.clone(), lam, perm)
    assert torch.allclose(mixed[2], 0.7 * images[2] + 0.3 * images[3])
    logits, labels = torch.randn(6, 4), torch.tensor([0, 1, 2, 3, 0, 1])
    target = 0.7 * F.one_hot(labels, 4).float() + 0.3 * F.one_hot(labels[perm], 4).float()
    assert torch.allclose(M.loss(logits, labels, lam, perm), F.cross_entropy(logits, target))
    # lam = 1 is plain cross-entropy, class weights included.
    weight = torch.tensor([1.0, 2.0, 0.5, 1.0])
    assert torch.allclose(M.loss(logits, labels, 1.0, perm, weight), F.cross_entropy(logits, labels, weight=weight))


def test_training_with_mixup_is_repeatable_and_differs_from_training_without(synth_data, tmp_path):
    import io

    from dtrain.train import checkpoint as ckpt
    from dtrain.train.config import TrainConfig
    from dtrain.train.trainer import run

    threads = torch.get_num_threads()  # run() sets the process's intra-op threads

    def weights(name, **kw):
        cfg = TrainConfig.model_validate({
            "data": {"root": str(synth_data), "image_size": 32, "num_workers": 0}, "model": {"arch": "small_resnet"},
            "epochs": 1, "max_steps": 3, "batch_size": 8, "precision": "fp32", "device": "cpu", "threads": 1,
            "deterministic": True, "val_every_epoch": False, "output_dir": str(tmp_path / name), **kw})
        run(cfg, stream=io.StringIO())
        return ckpt.load(ckpt.find_resume(tmp_path / name))["model"]

    try:
        plain, mixed, again = weights("plain"), weights("mixed", mixup_alpha=1.0), weights("again", mixup_alpha=1.0)
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(mixed[k], again[k]) for k in mixed)
    assert max((mixed[k].float() - plain[k].float()).abs().max().item() for k in plain) > 1e-4
