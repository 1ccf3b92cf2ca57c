"""Pixel supervision (owner: train): each training photo's defect mask rides as a fourth
channel through resize, cache and augmentation, a head on the network's third stage learns
to draw it (TrainConfig.mask_loss), the checkpoint's "model" stays the classifier alone, and
the recipe turns it on where defective photos have masks. Exact resume with the mask head
under DDP: tests/test_train_ddp.py (recipe-options)."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from dtrain.data import mask_targets
from dtrain.data.config import DataConfig
from dtrain.data.datasets import open_split
from dtrain.data.synth import CLASSES, SPLITS, defect_mask, render_image, synthesize
from dtrain.models.build import build_model
from dtrain.models.config import ModelConfig
from dtrain.models.mask_head import tap, with_mask_head
from dtrain.recipe.decide import mask_supervision
from dtrain.recipe.stats import gather
from dtrain.train.mask_loss import mask_loss


def _noise(shape, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(40, 110, shape, dtype=np.uint8)


def _set(root: Path) -> None:
    """Class folders. ok: 4 upright noise photos (60 x 30), no masks. dent: 4 photos with a
    bright 12 x 10 block at a different place each, and its mask beside; one more without a
    mask, and one whose mask is empty."""
    for i in range(4):
        (root / "ok").mkdir(parents=True, exist_ok=True)
        Image.fromarray(_noise((60, 30), i)).save(root / "ok" / f"ok_{i}.png")
    for i in range(6):
        d = root / "dent"
        d.mkdir(parents=True, exist_ok=True)
        img, mask = _noise((60, 30), 100 + i), np.zeros((60, 30), np.uint8)
        y, x = 4 + 8 * i, 3 + 3 * i
        img[y:y + 12, x:x + 10] = 250
        mask[y:y + 12, x:x + 10] = 255
        Image.fromarray(img).save(d / f"dent_{i}.png")
        if i < 4:
            Image.fromarray(mask).save(d / f"dent_{i}_mask.png")
        elif i == 5:
            Image.fromarray(np.zeros_like(mask)).save(d / f"dent_{i}_mask.png")


@pytest.mark.parametrize("cache", [False, True])
def test_each_photo_carries_its_mask_through_resize_turn_and_augmentation(tmp_path, cache):
    _set(tmp_path)
    cfg = DataConfig(root=str(tmp_path), layout="classfolders", split_fractions=(1.0, 0.0, 0.0), image_size=32,
                     image_width=64, shift=0.2, cache_decoded=cache)
    ds = open_split(cfg, "train", train=True, masks=True)
    names = {Path(p).name: i for i, p in enumerate(ds.paths)}
    assert len(ds) == 10  # the masks are no photos of their own
    for draw in range(6):
        for name, i in names.items():
            torch.manual_seed(draw * 100 + i)  # as the loader seeds every sample
            x, _ = ds[i]
            assert x.shape == (4, 32, 64) and x.dtype == torch.uint8
            mask = x[3]
            if name.startswith("ok"):
                assert not mask.any()  # a good part without a mask is clear
            elif name in ("dent_4.png", "dent_5.png"):  # none, or an empty one: where the defect is, unknown
                assert (mask == mask_targets.UNKNOWN).all()
            else:
                marked = mask == mask_targets.MARKED
                assert set(mask.unique().tolist()) == {0, mask_targets.MARKED}
                # The block is where its mask is, after the quarter turn into the wide input,
                # the flips and the shift: bright inside, the noise's level outside.
                assert x[0][marked].float().mean() > 180 and x[0][~marked].float().mean() < 130, (name, draw)


def test_the_mask_loss_pools_by_max_and_leaves_out_photos_without_a_mask():
    masks = torch.zeros((3, 1, 16, 16), dtype=torch.uint8)
    masks[0, 0, 5, 9] = mask_targets.MARKED  # one marked pixel
    masks[2] = mask_targets.UNKNOWN
    logits = torch.zeros((3, 1, 4, 4))
    logits[0, 0, 1, 2] = 4.0  # the cell that covers pixel (5, 9): right about it
    target0 = torch.zeros((1, 4, 4))
    target0[0, 1, 2] = 1.0
    expected = (torch.nn.functional.binary_cross_entropy_with_logits(logits[0], target0)
                + torch.nn.functional.binary_cross_entropy_with_logits(logits[1], torch.zeros((1, 4, 4)))) / 2
    assert torch.allclose(mask_loss(logits, masks), expected)
    # the photo without a mask changes nothing, whatever the head says of it
    wild = logits.clone()
    wild[2] = 9.0
    assert torch.allclose(mask_loss(wild, masks), expected)
    # mixup: the target is the same blend of the two masks; a pair with an unknown mask is out
    perm = torch.tensor([1, 0, 0])
    blended = torch.nn.functional.binary_cross_entropy_with_logits(logits[:2], 0.75 * torch.stack([target0, 0 * target0])
                                                                   + 0.25 * torch.stack([0 * target0, target0]))
    assert torch.allclose(mask_loss(logits, masks, 0.75, perm), blended)


@pytest.mark.parametrize("arch,stem,width", [("small_resnet", 1, 128), ("small_resnet", 2, 128), ("resnet18", 1, 256)])
def test_the_head_reads_the_third_stage_and_leaves_the_classifier_as_built(arch, stem, width):
    net = build_model(ModelConfig(arch=arch, stem_stride=stem, input_norm="per_image", pool="avgmax"), 3)
    keys = list(net.state_dict())
    assert tap(net)[1] == width
    both = with_mask_head(net)
    logits, maps = both(torch.randn(2, 3, 64, 64))
    assert logits.shape == (2, 3) and maps.shape[:2] == (2, 1)
    assert maps.shape[-1] == 64 // (8 if arch == "small_resnet" and stem == 1 else 16)
    assert list(net.state_dict()) == keys  # checkpoints, export and pretrained files see the same network
    net.eval()
    with torch.no_grad():
        assert torch.equal(net(torch.ones(1, 3, 64, 64)), both.eval()(torch.ones(1, 3, 64, 64))[0])


def test_synth_masks_mark_exactly_what_the_defects_changed(tmp_path):
    synthesize(tmp_path, images=60, size=32, seed=3, workers=1, masks=True)
    masks = sorted(tmp_path.glob("*/*/*_mask.png"))
    assert masks and not list(tmp_path.glob("*/ok/*_mask.png"))
    assert len(masks) == sum(1 for p in tmp_path.glob("*/*/*.png") if p.parent.name != "ok" and "_mask" not in p.name)
    for mask_path in masks[:12]:
        split, cls, number = mask_path.parent.parent.name, mask_path.parent.name, int(mask_path.stem.split("_")[1])
        args = (3, SPLITS.index(split), CLASSES.index(cls), number, 32, 0.5)
        img, clean = render_image(*args), render_image(*args, with_defect=False)
        mask = np.asarray(Image.open(mask_path))
        assert np.array_equal(mask, defect_mask(img, clean)) and mask.any()
        assert np.array_equal(img[mask == 0], clean[mask == 0])  # outside the mask the part is untouched
        assert np.array_equal(np.asarray(Image.open(mask_path.with_name(f"{cls}_{number:05d}.png"))), img)


def test_the_recipe_trains_with_masks_where_defective_photos_have_them(tmp_path):
    with_masks, without = tmp_path / "masked", tmp_path / "plain"
    synthesize(with_masks, images=90, size=32, seed=1, workers=1, masks=True)
    synthesize(without, images=90, size=32, seed=1, workers=1)
    stats = gather(DataConfig(root=str(with_masks), image_size=32))
    defects = sum(n for c, n in stats.train_counts.items() if c != "ok")
    assert stats.masked_defects == defects > 0
    on = mask_supervision(stats)
    assert on.value == 1.0 and f"{defects} of the {defects} defective training photos have a mask" in on.reason
    assert mask_supervision(gather(DataConfig(root=str(without), image_size=32))).value is None


def test_training_with_masks_keeps_the_classifier_alone_in_the_checkpoint(tmp_path):
    from dtrain.train import checkpoint as ckpt
    from dtrain.train.config import TrainConfig
    from dtrain.train.trainer import run

    synthesize(tmp_path / "data", images=90, size=32, seed=2, workers=1, masks=True)
    threads = torch.get_num_threads()  # run() sets the process's intra-op threads

    def train(name, **kw):
        cfg = TrainConfig.model_validate({
            "data": {"root": str(tmp_path / "data"), "image_size": 32, "num_workers": 0},
            "model": {"arch": "small_resnet", "pool": "avgmax"}, "epochs": 1, "max_steps": 4, "batch_size": 8,
            "precision": "fp32", "device": "cpu", "threads": 1, "deterministic": True, "val_every_epoch": False,
            "output_dir": str(tmp_path / name), **kw})
        run(cfg, stream=io.StringIO())
        return ckpt.load(ckpt.find_resume(tmp_path / name))

    try:
        masked, plain = train("masked", mask_loss=1.0), train("plain")
    finally:
        torch.set_num_threads(threads)
    assert set(masked["model"]) == set(plain["model"])  # what eval and export load: the classifier
    net = build_model(ModelConfig(arch="small_resnet", pool="avgmax"), len(masked["classes"]))
    net.load_state_dict(masked["model"])  # strict
    assert "mask_head" in masked and "mask_head" not in plain
    # the head's loss reached the shared features: the same seed trains other weights
    assert any(not torch.equal(masked["model"][k], plain["model"][k]) for k in plain["model"])


def _png(path: Path, array: np.ndarray) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(array).save(path)
    return path


def test_masks_are_found_as_published_sets_lay_them_out(tmp_path):
    photo, mask = _noise((20, 20), 1), np.where(np.eye(20, dtype=bool), 255, 0).astype(np.uint8)
    expected = {}
    # MVTec-AD: a ground-truth tree beside test/, mirroring its defect folders; good parts have none
    expected[_png(tmp_path / "mv/bottle/test/crack/000.png", photo)] = tmp_path / "mv/bottle/ground_truth/crack/000_mask.png"
    expected[_png(tmp_path / "mv/bottle/test/good/000.png", photo)] = None
    expected[_png(tmp_path / "mv/bottle/train/good/000.png", photo)] = None
    # VisA: Data/Images/<class>/ beside Data/Masks/<class>/, the same stem in another format
    expected[_png(tmp_path / "visa/Data/Images/Anomaly/000.jpg", photo)] = tmp_path / "visa/Data/Masks/Anomaly/000.png"
    expected[_png(tmp_path / "visa/Data/Images/Normal/0000.jpg", photo)] = None
    # magnetic tiles: the photo's mask beside it in Imgs/, same stem; KolektorSDD2: a _GT suffix
    expected[_png(tmp_path / "mt/MT_Blowhole/Imgs/exp1_num_4727.jpg", photo)] = tmp_path / "mt/MT_Blowhole/Imgs/exp1_num_4727.png"
    expected[_png(tmp_path / "k2/train/10000.png", photo)] = tmp_path / "k2/train/10000_GT.png"
    for target in filter(None, expected.values()):
        _png(target, mask)
    found = mask_targets.mask_files([str(p) for p in expected])
    assert found == [None if m is None else str(m) for m in expected.values()]


def test_fold_folders_of_links_carry_each_photos_mask(tmp_path):
    """k-fold (recipe/oof.py) trains on folders of links: each photo's mask is linked beside
    its link, so the fold runs read the same pixel labels as the photos' own folders give."""
    from dtrain.recipe.folds import link_split
    from dtrain.recipe.oof import labelled

    synthesize(tmp_path / "data", images=90, size=32, seed=4, workers=1, masks=True)
    classes, paths, targets = labelled(DataConfig(root=str(tmp_path / "data"), image_size=32))
    masks = mask_targets.mask_files(paths)
    assert sum(m is not None for m in masks) == sum(t != classes.index("ok") for t in targets) > 0
    link_split(tmp_path / "fold", "train", classes, paths, targets, masks)
    fold = open_split(DataConfig(root=str(tmp_path / "fold"), image_size=32, val_split=""), "train", train=False, masks=True)
    assert len(fold.paths) == len(paths)  # the mask links are paired, not listed as photos
    linked = {Path(p).resolve(): m for p, m in zip(fold.paths, fold.masks)}
    for photo, mask in zip(paths, masks):
        found = linked[Path(photo).resolve()]
        assert (found is None) == (mask is None)
        assert found is None or Path(found).resolve() == Path(mask).resolve()
    # Without masks (a recipe without mask_loss) the links are the photos alone.
    link_split(tmp_path / "plain", "train", classes, paths, targets)
    assert not any(m for m in mask_targets.mask_files([str(p) for p in (tmp_path / "plain").glob("train/*/*")]))
