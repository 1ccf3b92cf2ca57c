"""The threshold on a small validation split: k-fold planning, stratified folds, linked fold
folders, what the threshold rests on (in words), and the wall-clock budget rule."""

from __future__ import annotations

import os

import numpy as np
import pytest

from dtrain.errors import DtrainError
from dtrain.evaluation.evaluate import load_scores, save_scores, summarise
from dtrain.evaluation.predict import Predictions
from dtrain.recipe import budget as B
from dtrain.recipe import decide as D
from dtrain.recipe.decide import BUDGET_IMAGES, Decision
from dtrain.recipe.folds import MAX_FOLDS, MIN_FOLDS, assign_folds, link_split, plan_folds


def test_kfold_only_when_validation_cannot_show_the_target():
    labelled = {"ok": 2000, "scratch": 150, "pit": 30}
    enough = plan_folds(600, labelled, "ok", 0.005)
    assert enough.k == 0 and "no k-fold" in enough.reason and "598" in enough.reason
    few = plan_folds(80, labelled, "ok", 0.005)
    assert few.k == MAX_FOLDS and "only 80 defective validation images" in few.reason and "all 180" in few.reason
    assert plan_folds(80, {"ok": 500, "crack": 4, "pit": 40}, "ok", 0.005).k == 4  # the rarest class has 4
    # Never under MIN_FOLDS: 2 fold models, each learning from half the images, did not stand for the final model.
    assert MIN_FOLDS == 4
    assert plan_folds(80, {"ok": 500, "crack": 3, "pit": 40}, "ok", 0.005).k == MIN_FOLDS
    assert plan_folds(80, {"ok": 500, "crack": 1}, "ok", 0.005).k == MIN_FOLDS
    assert plan_folds(0, {"a": 40, "b": 40}, None, 0.005).k == 0  # classification: no threshold


def test_folds_are_stratified_balanced_and_seeded():
    targets = [0] * 103 + [1] * 17 + [2] * 6
    folds = assign_folds(targets, 5, seed=0)
    assert folds == assign_folds(targets, 5, seed=0) and folds != assign_folds(targets, 5, seed=1)
    sizes = np.bincount(folds, minlength=5)
    assert sizes.max() - sizes.min() <= 1
    for cls, n in ((0, 103), (1, 17), (2, 6)):
        per_fold = np.bincount([f for f, t in zip(folds, targets) if t == cls], minlength=5)
        assert per_fold.sum() == n and per_fold.max() - per_fold.min() <= 1


def test_link_split_keeps_every_class_and_distinct_names(tmp_path):
    src = tmp_path / "src"
    (src / "a").mkdir(parents=True)
    (src / "b").mkdir(parents=True)
    for d in ("a", "b"):
        (src / d / "000.png").write_bytes(b"x")  # the same name twice, as MVTec's train/good and test/good
    link_split(tmp_path / "fold", "train", ["bent", "good"], [str(src / "a" / "000.png"), str(src / "b" / "000.png")], [1, 1])
    assert sorted(os.listdir(tmp_path / "fold" / "train")) == ["bent", "good"]
    links = sorted((tmp_path / "fold" / "train" / "good").iterdir())
    assert len(links) == 2 and [os.readlink(p) for p in links] == [str(src / "a" / "000.png"), str(src / "b" / "000.png")]


def _pred(p_def: list[float], defect: list[bool]) -> Predictions:
    p = np.asarray(p_def)
    return Predictions(probs=np.stack([1 - p, p], axis=1), targets=np.asarray(defect, dtype=np.int64),
                       paths=[f"{i}.png" for i in range(len(p))], bad_files=[])


def test_the_report_says_what_the_threshold_rests_on_and_warns_in_plain_words():
    rng = np.random.default_rng(0)
    # 300 defects, 1 faint one among them; 1700 OK parts.
    d = np.concatenate([rng.uniform(0.6, 1.0, 299), [0.2]])
    o = rng.uniform(0.0, 0.3, 1700)
    oof = _pred(list(d) + list(o), [True] * 300 + [False] * 1700)
    test = _pred([0.9, 0.1], [True, False])
    res = summarise(["ok", "scratch"], 0, oof, test, 0.005, "bound95", "out-of-fold scores of 5 fold models")
    b = res["threshold_basis"]
    assert b["n_defective"] == 300 and b["n_missed"] == 0 and b["source"].startswith("out-of-fold")
    assert b["achievable_miss_rate_upper95"] == pytest.approx(1 - 0.05 ** (1 / 300))  # ~3/n
    assert b["false_alarm_rate"] == pytest.approx(np.mean(o >= res["threshold"]))
    assert not b["target_shown"] and b["defective_needed_for_target"] == 598
    warning = b["warning"]
    assert warning in res["warnings"] and "not proven" in warning and "300 defective images" in warning
    assert "fewer than 1.0% of defects are missed" in warning and "about 298 more" in warning
    enough = summarise(["ok", "scratch"], 0, _pred([0.9] * 600 + [0.1] * 50, [True] * 600 + [False] * 50), test, 0.005, "bound95")
    assert enough["threshold_basis"]["target_shown"] and enough["threshold_basis"]["warning"] is None


def test_scores_round_trip(tmp_path):
    pred = _pred([0.2, 0.7], [False, True])
    save_scores(tmp_path / "s.npz", pred)
    back = load_scores(tmp_path / "s.npz")
    assert np.array_equal(back.probs, pred.probs) and back.paths == pred.paths and list(back.targets) == [0, 1]


def _wanted(side: int) -> Decision:
    return Decision("data.image_size", side, "the data's choice")


def test_budget_keeps_the_data_side_when_it_fits():
    fit = B.fit_budget(_wanted(256), runs=1, budget_s=1800, seconds_per_image=lambda s: 1e-4)
    assert fit.side.value == 256 and fit.images_seen == BUDGET_IMAGES and fit.warning is None
    assert fit.side.reason == "the data's choice"


def test_budget_shrinks_the_side_to_fit_every_run():
    # 5 ms per image at 256 px, scaling with pixels; 4 runs in 30 min: 1350 s / 4 - 60 s = 277.5 s each.
    cost = B.scaled(0.005, 256)
    fit = B.fit_budget(_wanted(256), runs=4, budget_s=1800, seconds_per_image=cost)
    per_run = 1800 * B.TRAIN_SHARE / 4 - B.RUN_OVERHEAD_S
    assert fit.warning is None and per_run / cost(fit.side.value) >= BUDGET_IMAGES
    assert per_run / cost(fit.side.value + 32) < BUDGET_IMAGES and fit.side.value == 192
    assert "largest side that affords" in fit.side.reason and "4 run(s)" in fit.reason
    assert fit.seconds == per_run  # each run's time_budget_s


def test_a_small_set_spends_the_budget_on_pixels_not_on_repeats():
    # 270 training images are capped at MAX_EPOCHS passes: 27 000 seen, not BUDGET_IMAGES.
    assert B.images_needed(270) == 270 * D.MAX_EPOCHS < BUDGET_IMAGES and B.images_needed(5000) == BUDGET_IMAGES
    cost = B.scaled(0.005, 256)  # at 90 000 images, 4 runs in 30 min fit only 192 px (the test above)
    fit = B.fit_budget(_wanted(256), runs=4, budget_s=1800, seconds_per_image=cost, needed=B.images_needed(270))
    assert fit.side.value == 256 and fit.warning is None
    assert D.epochs(270, fit.images_seen).value == D.MAX_EPOCHS  # still capped by the epochs rule, not cut
    # k-fold asks its runs for half of what one run needs, so a small set keeps its folds where a large one would not.
    kept, _, _ = B.fit_folds(_wanted(256), 4, 1800, cost, needed=B.images_needed(270))
    assert kept == 4 and B.fit_folds(_wanted(256), 4, 1800, cost)[0] == 0


def test_budget_floor_cuts_images_and_warns():
    fit = B.fit_budget(_wanted(256), runs=6, budget_s=1800, seconds_per_image=lambda s: 0.5)
    assert fit.side.value == 128 and fit.images_seen < BUDGET_IMAGES and "weaker model" in fit.warning
    small = B.fit_budget(_wanted(64), runs=1, budget_s=120, seconds_per_image=lambda s: 0.5)
    assert small.side.value == 64 and small.images_seen == 60  # 2 min: 90 s, less the run's 60 s start
    # Half of 160 px would be 96, but under a strided stem (from 128 px) that leaves the blocks 48 px.
    strided = B.fit_budget(_wanted(160), runs=6, budget_s=1800, seconds_per_image=lambda s: 0.5)
    assert strided.side.value == D.STRIDED_STEM_FROM
    # A strided stem's input is the native side (decide.input_side): its floor is a quarter of it, not half.
    native = B.fit_budget(_wanted(640), runs=6, budget_s=1800, seconds_per_image=lambda s: 0.5)
    assert native.side.value == 160 and "a quarter of the native side" in native.side.reason


def test_a_budget_with_no_time_left_to_train_is_refused_with_the_least_that_works():
    # 1 min: 45 s for training, less the run's ~60 s start. Before, a train.yaml with
    # time_budget_s 0 was written, and the trainer refused it after the probe and the scan.
    with pytest.raises(DtrainError, match=r"a 1 min budget leaves the run 0 s to train") as err:
        B.fit_budget(_wanted(64), runs=1, budget_s=60, seconds_per_image=lambda s: 1e-4)
    assert err.value.hint == "give --budget-minutes 2 or more"
    B.require_training_time(120, 1)  # 30 s to train: kept
    with pytest.raises(DtrainError, match="leaves each of the 5 runs") as err:
        B.require_training_time(300, 5)
    assert err.value.hint == "give --budget-minutes 8 or more (or fewer --folds)"
    B.require_training_time(8 * 60, 5)
    for runs in (1, 2, 5):  # a budget the recipe names in a hint is never one it refuses
        B.require_training_time(B._minutes_for(0.5, runs) * 60, runs)


def test_the_probe_takes_fewer_pictures_per_step_as_they_grow():
    """At most 16 pictures of 320 px worth of pixels per step, never under 4: the probe runs at the data's own
    side, often the largest the quickstart touches, and at 640 px batch 16 took 4.5 GB on 2 ranks."""
    sizes = list(range(32, 1300, 8))
    batches = [B.probe_batch(s) for s in sizes]
    assert batches == sorted(batches, reverse=True) and batches[0] == 16 and batches[-1] == 4
    assert (B.probe_batch(320), B.probe_batch(352), B.probe_batch(640)) == (16, 13, 4)
    assert all(b * s * s <= 16 * 320 * 320 for s, b in zip(sizes, batches) if b > 4)


def test_probe_times_a_real_training_step():
    import torch

    threads = torch.get_num_threads()
    for ranks in (1, 2):  # two ranks are timed side by side, in two threads
        assert 0 < B.probe({"arch": "small_resnet", "pool": "avgmax", "input_norm": "per_image"}, 32, 3, precision="fp32", ranks=ranks, batch=4) < 5
    # With masks the run trains the mask head beside the classifier: the probe steps both (two outputs, two losses).
    assert 0 < B.probe({"arch": "small_resnet", "pool": "avgmax", "input_norm": "per_image", "stem_stride": 2}, 64, 3,
                       precision="fp32", ranks=2, batch=4, mask_head=True) < 5
    assert torch.get_num_threads() == threads
    # A rank that fails raises in the caller; the other is released from the start barrier, not left waiting.
    with pytest.raises(ValueError, match="arch"):
        B.probe({"arch": "no_such_net"}, 32, 3, precision="fp32", ranks=2, batch=4)


def test_the_probe_steps_the_mask_head_where_the_run_trains_one(monkeypatch):
    """With masks the probe times what the run does: the head's forward, its loss, its backward and its step."""
    import torch

    from dtrain.models import mask_head as MH

    made, original = [], MH.with_mask_head

    def recording(net, norm_layer=torch.nn.BatchNorm2d):
        wrapped = original(net, norm_layer)
        made.append((wrapped, [p.detach().clone() for p in wrapped.head.parameters()]))
        return wrapped

    monkeypatch.setattr(MH, "with_mask_head", recording)
    cfg = {"arch": "small_resnet", "pool": "avgmax", "input_norm": "per_image", "stem_stride": 2}
    B.probe(cfg, 64, 3, precision="fp32", ranks=1, batch=4, mask_head=True)
    assert len(made) == 1
    wrapped, before = made[0]
    assert any(not torch.equal(a, b) for a, b in zip(before, wrapped.head.parameters()))  # trained, not just built
    B.probe(cfg, 64, 3, precision="fp32", ranks=1, batch=4)
    assert len(made) == 1  # without masks no head


def test_stats_read_headers_through_the_hardened_decoder(tmp_path):
    from PIL import Image

    from dtrain.data.config import DataConfig
    from dtrain.recipe.decide import notes
    from dtrain.recipe.stats import gather

    rng = np.random.default_rng(0)
    for split in ("train", "val"):
        for cls in ("ok", "pit"):
            (tmp_path / split / cls).mkdir(parents=True)
    grey = rng.integers(0, 255, (40, 60), dtype=np.uint8)
    Image.fromarray(grey).save(tmp_path / "train" / "ok" / "grey.png")  # grey mode: header only
    Image.fromarray(np.stack([grey] * 3, axis=2)).save(tmp_path / "train" / "ok" / "grey_rgb.png")  # decoded to tell
    Image.fromarray(rng.integers(0, 255, (50, 70, 3), dtype=np.uint8)).save(tmp_path / "train" / "pit" / "colour.png")
    frames = [Image.fromarray(grey), Image.fromarray(255 - grey)]
    frames[0].save(tmp_path / "train" / "pit" / "anim.gif", save_all=True, append_images=frames[1:])
    (tmp_path / "train" / "pit" / "broken.png").write_bytes(b"not a png")
    stats = gather(DataConfig(root=str(tmp_path)))
    assert sorted(stats.short_sides) == [40, 40, 50] and stats.grey_share == pytest.approx(2 / 3)
    assert set(map(os.path.basename, stats.refused)) == {"anim.gif", "broken.png"}
    assert "frames" in stats.refused[str(tmp_path / "train" / "pit" / "anim.gif")]
    assert any("2 of the sampled training images are refused" in n for n in notes(stats))
    # Only COLOUR_SAMPLE colour-mode images are decoded: with 1, the first (grey_rgb) stands for both.
    assert gather(DataConfig(root=str(tmp_path)), colour_sample=1).grey_share == 1.0


def test_kfold_is_kept_only_while_every_run_sees_enough_images_at_one_runs_side():
    wanted = _wanted(256)
    k, fit, why = B.fit_folds(wanted, 5, 1800, B.scaled(1e-4, 256))
    assert (k, why, fit.side.value, fit.images_seen) == (5, "", 256, BUDGET_IMAGES)
    # 4 ms per image at 256 px: one run affords 1290 s / 0.004 = 322 500 images at 256 px; 6 runs 165 s = 41 250 each,
    # 5 runs 210 s = 52 500 (over half of 90 000): 4 folds, still at 256 px.
    k, fit, why = B.fit_folds(wanted, 5, 1800, B.scaled(0.004, 256))
    assert (k, fit.side.value, fit.images_seen) == (4, 256, 52_500) and "lowered from 5 to 4" in why
    # 10 ms: 5 runs see 21 000 each; 3 runs would see 39 000, but fewer than MIN_FOLDS folds are never run.
    k, fit, why = B.fit_folds(wanted, 5, 1800, B.scaled(0.01, 256))
    assert (k, fit.side.value, fit.images_seen) == (0, 256, BUDGET_IMAGES) and "5 runs at 256 px" in why
    # 100 ms at 256 px: one run needs the floor, 128 px (51 600 images); 5 runs there: 7 800 each.
    k, fit, why = B.fit_folds(wanted, 5, 1800, B.scaled(0.1, 256))
    assert (k, fit.side.value, fit.images_seen) == (0, 128, 51_600)
    # The budget named is one that really keeps 4 folds: more time first raises one run's side, so the folds must
    # afford 256 px, (45000*0.1+60)*5/0.75 s = 507 min, and still when the rerun's probe measures 10 % slower:
    # (45000*0.11+60)*5/0.75 s = 556.7 min, rounded up.
    assert "threshold is chosen on the validation split" in why and "--budget-minutes 557 would afford 4 folds" in why
    for cost in (0.1, 0.11):
        assert B.fit_folds(wanted, 5, 557 * 60, B.scaled(cost, 256))[0] == 4
    assert B.fit_folds(wanted, 5, 507 * 60, B.scaled(0.1, 256))[0] == 4
    assert B.fit_folds(wanted, 5, 507 * 60, B.scaled(0.11, 256))[0] == 0  # what the hint without slack risked
    assert B.fit_folds(wanted, 0, 1800, B.scaled(0.1, 256))[0] == 0
    # ...and since that budget first buys one run 256 px, the user who wants the folds at today's 128 px is told
    # what `--folds 4` needs for it (every run 90 000 images): (90000*0.025*1.1+60)*5/0.75 s = 281.7 min, rounded up.
    assert "at 256 px, the side one run gets by then; --folds 4 --budget-minutes 282 runs them at 128 px" in why
    for cost in (0.1, 0.11):
        fit = B.fit_budget(wanted, 5, 282 * 60, B.scaled(cost, 256))
        assert (fit.side.value, fit.warning) == (128, None)
    assert B.fit_budget(wanted, 5, 281 * 60, B.scaled(0.11, 256)).warning is not None
    # At the data's own side there is nothing to trade: one budget is named.
    why = B.fit_folds(wanted, 5, 1800, B.scaled(0.01, 256))[2]
    assert why.endswith("(--budget-minutes 62 would afford 4 folds here)"), why


def test_the_html_report_shows_the_threshold_basis(tmp_path):
    from dtrain.evaluation.html_report import render_html

    oof = _pred([0.9] * 40 + [0.1] * 200, [True] * 40 + [False] * 200)
    res = summarise(["ok", "scratch"], 0, oof, _pred([0.9, 0.1], [True, False]), 0.005, "bound95",
                    "out-of-fold scores of 5 fold models over train + val")
    page = render_html(res, tmp_path)
    assert "chosen on the out-of-fold scores of 5 fold models over train + val" in page
    assert "best miss-rate bound these defects can show" in page and "7.22 %" in page  # 1 - 0.05^(1/40)
    assert "not proven" in page and "about 558 more" in page
