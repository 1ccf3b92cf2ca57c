"""Defects lifted off masked photos and laid onto defect-free ones while training
(data.transplant, dtrain/data/transplant.py): the lifted defect is the change it made to
the surface, it lands whole at a random turn and place with its class and mask, a grey
part stays grey, a seeded draw is reproducible, a defect may be laid fainter than it was
photographed (data.transplant_min_strength), and where a set has no defect-free class a
defective photo's own defect is taken off before another is laid on. Exact resume with it under DDP:
tests/test_train_ddp.py (recipe-options)."""

from __future__ import annotations

import shutil

import pytest
import torch
from pydantic import ValidationError

from dtrain.data.config import DataConfig
from dtrain.data.datasets import InspectionDataset, open_split
from dtrain.data.mask_targets import MARKED, UNKNOWN
from dtrain.data.synth import synthesize
from dtrain.data.transplant import DILATE, Transplants, lay, lift, take_off
from dtrain.errors import ConfigError
from dtrain.train.config import TrainConfig


def _photo(h: int = 96, w: int = 96) -> torch.Tensor:
    """A smooth part (a gradient 80..120 across) with a clear mask channel."""
    ramp = torch.linspace(80, 120, w).round().to(torch.uint8).expand(h, w)
    return torch.cat([ramp.expand(3, h, w), torch.zeros(1, h, w, dtype=torch.uint8)]).contiguous()


def _drop_ok(root) -> None:
    """A defect-types-only copy: the defect-free folders removed."""
    for split in ("train", "val", "test"):
        shutil.rmtree(root / split / "ok")


def _disc(h: int, w: int, cy: int, cx: int, r: int) -> torch.Tensor:
    yy, xx = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
    return (yy - cy) ** 2 + (xx - cx) ** 2 <= r * r


def test_a_lifted_defect_is_the_change_it_made_to_the_surface():
    donor = _photo()
    disc = _disc(96, 96, 40, 60, 6)
    donor[:3][:, disc] -= torch.tensor([30, 20, 10], dtype=torch.uint8)[:, None]  # a tinted dark spot
    donor[3][disc] = MARKED
    change, mask, corner = lift(donor)
    # The crop is the mask's box widened by DILATE on every side.
    assert change.shape == (3, 13 + 2 * DILATE, 13 + 2 * DILATE) and mask.shape == (1, *change.shape[1:])
    assert corner == (40 - 6 - DILATE, 60 - 6 - DILATE)
    inside = _disc(*change.shape[1:], 6 + DILATE, 6 + DILATE, 6)
    assert (change[:, inside].float().mean(1) - torch.tensor([-30.0, -20.0, -10.0])).abs().max() <= 2
    assert change[:, ~(mask[0] > 0)].abs().max() == 0  # nothing outside the widened mask
    assert (mask[0][inside] == MARKED).all()
    # Taken off, the spot is gone: the part is its smooth self again, its mask clear.
    clean = take_off(donor, (change, mask, corner))
    assert (clean[:3].int() - _photo()[:3].int()).abs().max() <= 2 and not clean[3].any()
    # A photo whose mask marks nothing, or is unknown, gives no donor.
    assert lift(_photo()) is None
    unknown = _photo()
    unknown[3] = UNKNOWN
    assert lift(unknown) is None


@pytest.mark.parametrize("grey", [True, False], ids=["grey part", "colour part"])
def test_a_laid_defect_lands_whole_with_its_mask(grey):
    donor = _photo()
    disc = _disc(96, 96, 40, 60, 6)
    donor[:3][:, disc] -= torch.tensor([30, 20, 10], dtype=torch.uint8)[:, None]
    donor[3][disc] = MARKED
    change, mask, _ = lift(donor)
    part = _photo(64, 128)
    if not grey:
        part[1] = part[1] // 2  # a tinted finish
    part[3] = 0
    torch.manual_seed(0)
    places = set()
    for _ in range(20):
        out = lay(part, change, mask)
        marked = out[3] == MARKED
        assert marked.sum() == (mask > 0).sum() and ((out[3] == 0) | marked).all()  # whole, nothing else marked
        moved = (out[:3].int() - part[:3].int()).abs().amax(0) > 0
        assert moved.any() and not moved[~marked].any()  # the part changes under the mask only
        if grey:
            assert torch.equal(out[0], out[1]) and torch.equal(out[1], out[2])
        else:
            assert not torch.equal(out[0], out[1])
        rows, cols = torch.nonzero(marked, as_tuple=True)
        places.add((int(rows.min()), int(cols.min())))
    assert len(places) > 10  # a random place each time
    torch.manual_seed(5)
    first = lay(part, change, mask)
    torch.manual_seed(5)
    assert torch.equal(first, lay(part, change, mask))  # seeded: reproducible


def _spot_donor() -> torch.Tensor:
    donor = _photo()
    disc = _disc(96, 96, 40, 60, 6)
    donor[:3][:, disc] -= torch.tensor([40, 40, 40], dtype=torch.uint8)[:, None]  # a grey dark spot
    donor[3][disc] = MARKED
    return donor


def _laid_depth(out: torch.Tensor, part: torch.Tensor) -> float:
    """How much darker the laid spot made the part, at its deepest."""
    return float((part[:3].int() - out[:3].int()).amax())


def test_a_defect_is_laid_at_the_strength_asked():
    change, mask, _ = lift(_spot_donor())
    part = _photo(64, 64)
    torch.manual_seed(1)
    full = lay(part, change, mask)
    torch.manual_seed(1)
    half = lay(part, change, mask, 0.5)
    # The same place and turn, the change halved (rounded), the mask whole.
    assert torch.equal(full[3], half[3])
    assert abs(_laid_depth(half, part) - _laid_depth(full, part) / 2) <= 1
    assert _laid_depth(full, part) >= 36


def test_transplants_draw_a_strength_only_when_asked():
    """min_strength 1 lays every defect as photographed and draws nothing more from torch's
    RNG (a run without the option is the run it was before it); below 1, each laid defect has
    its own strength in [min_strength, 1]."""
    donor, part = _spot_donor(), _photo()
    photos = [part, donor]
    targets = [0, 1]

    def draws(min_strength: float) -> list[tuple[torch.Tensor, float]]:
        t = Transplants(0.999, [1], targets, lambda j: photos[j], 0, min_strength)
        torch.manual_seed(3)
        out = []
        for _ in range(30):
            img, label = t(part, 0)
            assert label == 1
            out.append((img, _laid_depth(img, part)))
        out.append((torch.rand(()), 0.0))  # where the stream stands afterwards
        return out

    change, mask, _ = lift(donor)
    torch.manual_seed(3)
    by_hand = []
    for _ in range(30):
        torch.rand(())  # the share's draw
        torch.randint(0, 1, ())  # the donor's
        by_hand.append(lay(part, change, mask))
    after = torch.rand(())
    plain = draws(1.0)
    assert all(torch.equal(img, ref) for (img, _), ref in zip(plain, by_hand)) and torch.equal(plain[-1][0], after)
    full = plain[0][1]
    depths = [d for _, d in draws(0.5)[:-1]]
    assert all(full / 2 - 1 <= d <= full for d in depths)
    assert min(depths) < 0.7 * full and max(depths) > 0.85 * full  # spread over the range, not one value


def test_the_dataset_gives_defect_free_draws_a_donors_defect_and_class(tmp_path):
    synthesize(tmp_path, images=90, size=32, seed=5, workers=1, masks=True)
    cfg = DataConfig(root=str(tmp_path), image_size=32, transplant=0.9)
    ds = open_split(cfg, "train", train=True, masks=True)
    ok = ds.negative_index
    good = [i for i, t in enumerate(ds.targets) if t == ok]
    got = []
    for i in good:
        torch.manual_seed(i)
        img, target = ds[i]
        got.append(target)
        if target != ok:
            assert (img[3] == MARKED).any() and not (img[3] == UNKNOWN).any()
        torch.manual_seed(i)
        again, target_again = ds[i]
        assert target_again == target and torch.equal(again, img)
    assert sum(t != ok for t in got) > len(good) // 2 and len({t for t in got if t != ok}) > 1
    # Defective draws keep their own photo and label.
    bad = next(i for i, t in enumerate(ds.targets) if t != ok)
    assert ds[bad][1] == ds.targets[bad]
    plain = open_split(DataConfig(root=str(tmp_path), image_size=32), "train", train=True, masks=True)
    assert all(plain[i][1] == ok for i in good)
    # A set whose defective photos have no mask files gives no donor: every draw is itself.
    synthesize(tmp_path / "unmasked", images=90, size=32, seed=5, workers=1, masks=False)
    bare = open_split(DataConfig(root=str(tmp_path / "unmasked"), image_size=32, transplant=0.9), "train", train=True,
                      masks=True)
    assert bare.transplants is not None and not bare.transplants.donors
    assert all(bare[i][1] == bare.targets[i] for i in range(len(bare)))


def test_without_a_defect_free_class_a_defect_is_swapped_for_another(tmp_path):
    synthesize(tmp_path, images=120, size=32, seed=6, workers=1, masks=True)
    _drop_ok(tmp_path)
    cfg = DataConfig(root=str(tmp_path), image_size=32, transplant=0.9, negative_class=None)
    ds = open_split(cfg, "train", train=True, masks=True)
    plain = open_split(cfg.model_copy(update={"transplant": 0.0}), "train", train=True, masks=True)
    assert ds.negative_index is None and ds.transplants is not None
    relabelled = changed = moved = 0
    for i in range(len(ds)):
        torch.manual_seed(i)
        img, target = ds[i]
        own = plain[i][0]
        if torch.equal(img, own):
            continue
        changed += 1
        relabelled += target != ds.targets[i]
        # The photo's own defect is gone from where it was, unless the laid one covers it.
        marked = img[3] == MARKED
        assert marked.any() and not (img[3] == UNKNOWN).any()
        gone = (own[3] == MARKED) & ~marked
        if gone.any():
            moved += 1
            assert not torch.equal(img[:3][:, gone], own[:3][:, gone])
        torch.manual_seed(i)
        again, target_again = ds[i]
        assert target_again == target and torch.equal(again, img)
    assert changed > len(ds) // 2 and relabelled > len(ds) // 4 and moved > changed // 2


def test_transplant_needs_masks(tmp_path):
    with pytest.raises(ValidationError, match="mask_loss"):
        TrainConfig.model_validate({"data": {"root": str(tmp_path), "transplant": 0.5}})
    TrainConfig.model_validate({"data": {"root": str(tmp_path), "transplant": 0.5}, "mask_loss": 1.0})
    with pytest.raises(ConfigError, match="masks"):
        InspectionDataset([str(tmp_path / "a.png")], [1], ["ok", "dent"], 0, 32, transplant=0.5)
    # A fainter strength without transplants would change nothing: refused, saying what to set.
    with pytest.raises(ValidationError, match="data.transplant is 0"):
        DataConfig(root=str(tmp_path), transplant_min_strength=0.5)
    assert DataConfig(root=str(tmp_path), transplant=0.5, transplant_min_strength=0.5).transplant_min_strength == 0.5


def test_the_recipe_transplants_where_masks_and_good_parts_are(tmp_path):
    from dtrain.recipe.decide import TRANSPLANT, as_config, plan, transplant
    from dtrain.recipe.stats import gather

    synthesize(tmp_path / "masked", images=90, size=32, seed=7, workers=1, masks=True)
    synthesize(tmp_path / "plain", images=90, size=32, seed=7, workers=1)
    masked = gather(DataConfig(root=str(tmp_path / "masked"), image_size=32))
    on = transplant(masked)
    assert on.value == TRANSPLANT and f"{masked.masked_defects} masked defective photos" in on.reason
    assert as_config(plan(masked))["data"]["transplant"] == TRANSPLANT
    assert transplant(gather(DataConfig(root=str(tmp_path / "plain"), image_size=32))).value == 0
    _drop_ok(tmp_path / "masked")
    types = gather(DataConfig(root=str(tmp_path / "masked"), image_size=32, negative_class=None))
    assert transplant(types).value == TRANSPLANT and "own defects taken off" in transplant(types).reason
