"""Where the images come from and how they are prepared."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator

from dtrain.configio import StrictModel


class DataConfig(StrictModel):
    # A local directory, NAS mount, or storage URL (s3://bucket/prefix). URLs and
    # `layout: shards` are read through dtrain.data.shards.
    root: str = "data/defects"
    layout: Literal["imagefolder", "classfolders", "mvtec", "masklabels", "boxclasses", "csvlabels", "shards"] = (
        "imagefolder")
    # csvlabels: the table of labels, relative to root (or absolute); null: the one .csv in root.
    labels_file: str | None = None
    # MVTec-AD: the category folder under root (e.g. "metal_nut").
    category: str | None = None
    # The class of defect-free parts, which a "miss" is measured against (a defective
    # part judged as this one). "ok", "good" and "normal" stand for each other. null: the
    # data has no such class (defect types only), a classification task: evaluation
    # reports accuracy, per-class figures and the confusion matrix, no miss rates. The
    # default "ok" also finds one class whose name reads as defect-free ("MT_Free",
    # "ok_front", "no_defect": dtrain/data/layouts.py), and becomes null when none does (the training
    # log says so); any other name that is not a class is an error.
    negative_class: str | None = "ok"
    image_size: int = Field(64, ge=16, le=2048)
    # The input's width, when it is not a square: image_size rows by image_width columns,
    # the long side across. Long pictures (a strip camera's 1:2.5, a coil's 1:6) squashed to
    # a square lose most of their pixels along their length, so a thin scratch across it fades;
    # a rectangle keeps their proportions for the pixels' cost. A picture standing upright is
    # turned a quarter first (parts have no canonical orientation: the augmentation turns them
    # too). null: a square of image_size (dtrain/data/transforms.py: resize_uint8).
    image_width: int | None = Field(None, ge=16, le=4096)
    num_workers: int = Field(2, ge=0)
    augment: bool = True
    # With augment: shift each training image by up to this share of its side in x and y,
    # the border mirrored (dtrain/data/transforms.py). 0 = no shift.
    shift: float = Field(0.0, ge=0, le=0.25)
    # With the training photos' masks (TrainConfig.mask_loss): this share of the defect-free
    # training draws receives a defect lifted off a masked defective photo, as a change of the
    # surface, at a random turn and place, and takes its class and mask; without a defect-free
    # class, this share of the masked defective draws has its own defects taken off first
    # (dtrain/data/transplant.py). 0 = none.
    transplant: float = Field(0.0, ge=0, lt=1)
    # Each transplanted defect's change to the surface is scaled by a strength drawn uniformly
    # from [transplant_min_strength, 1], to thicken a labelled set's faint end (inspectors label
    # what they see), on which a no-miss threshold rests. 1 = laid as photographed, and no draw:
    # the same transplants as before this field. The recipe leaves it at 1: at 0.5 neither the
    # plant check nor the types-only copy improved (BENCHMARKS.md, session 30).
    transplant_min_strength: float = Field(1.0, gt=0, le=1)
    # How each epoch's training images are drawn. "uniform": a permutation, every image once.
    # "sqrt_inverse": with replacement, class c drawn in proportion to sqrt(n_c) (so each of
    # its images with weight 1/sqrt(n_c)): a class of 30 images among 1500 OK ones then fills
    # ~1 batch slot in 10 instead of 1 in 50, so the gradient sees rare defects every step,
    # without repeating their few images as often as full balancing would. Same epoch length.
    sampling: Literal["uniform", "sqrt_inverse"] = "uniform"
    train_split: str = "train"
    val_split: str = "val"
    test_split: str = "test"
    # MVTec-AD has no val split: it is carved out of test, per class, seeded (see
    # dtrain/data/layouts.py). mvtec_train_fraction moves test defects into train.
    split_seed: int = 0
    mvtec_val_fraction: float = Field(0.3, gt=0, lt=1)
    mvtec_train_fraction: float = Field(0.0, ge=0, lt=1)
    # classfolders (ROOT/<class>/*, no split folders: how a plant's labelled photos usually
    # arrive): every class is cut into these train/val/test shares of a seeded shuffle, so
    # a rare class has images in every split. Val gets a fifth (not the usual tenth): the
    # threshold and its miss-rate bound rest on val's defects, and their count bounds how
    # small a miss rate can be shown.
    split_fractions: tuple[float, float, float] = (0.6, 0.2, 0.2)
    # imagefolder with train/ and test/ but no val/: this share of every train class becomes
    # val (seeded, as above), and the val folder is not read.
    val_from_train: float = Field(0.0, ge=0, lt=1)
    # Bits a 16-bit image's samples really use: a 12-bit camera's raw values stored as they
    # come (0..4095) use 12. Those samples are shifted down by sample_bits - 8 (clipped at
    # 255), so their bits fill the 8-bit range; the default keeps the high byte, which
    # would leave a 12-bit image 16 grey levels. 8-bit images are not touched. The recipe
    # sets it from sampled 16-bit images (recipe/decide.py); exported models keep it.
    sample_bits: int = Field(16, ge=8, le=16)
    # Decode + resize every image once into one uint8 tensor (small sets only:
    # N * 3 * S * S bytes); workers then only augment.
    cache_decoded: bool = False
    # Node-local cache for remote shards, shared by the node's ranks and workers;
    # None = <tmp>/dtrain-shard-cache. Keyed by the data set's fingerprint.
    cache_dir: str | None = None
    cache_limit_gb: float = Field(10.0, gt=0)
    # fsspec options for root, e.g. {endpoint_url: "http://minio:9000"}. No credentials
    # here (the config is saved in every checkpoint): use the AWS environment/config.
    storage_options: dict[str, Any] = Field(default_factory=dict)

    @field_validator("image_width")
    @classmethod
    def _landscape(cls, v: int | None, info) -> int | None:
        side = info.data.get("image_size")
        if v is not None and side is not None and v < side:
            raise ValueError(f"image_width {v} is under image_size {side}: the input's long side runs across "
                             f"(upright pictures are turned a quarter); swap them, or set image_width: null for a square")
        return None if v == side else v

    @field_validator("transplant_min_strength")
    @classmethod
    def _strength_of_transplants(cls, v: float, info) -> float:
        # Without transplants the option would change nothing, silently.
        if v < 1 and not info.data.get("transplant"):
            raise ValueError(f"transplant_min_strength {v:g} scales transplanted defects, and data.transplant is 0: set "
                             "data.transplant (e.g. 0.5, with mask_loss), or leave transplant_min_strength at 1")
        return v

    @property
    def input_hw(self) -> tuple[int, int]:
        """The network input's (rows, columns)."""
        return input_hw(self.image_size, self.image_width)

    @field_validator("split_fractions")
    @classmethod
    def _shares(cls, v: tuple[float, float, float]) -> tuple[float, float, float]:
        if min(v) < 0 or v[0] <= 0 or abs(sum(v) - 1) > 1e-6:
            raise ValueError("train, val and test shares must be >= 0 (train > 0) and sum to 1, e.g. [0.6, 0.2, 0.2]")
        return v


def input_hw(image_size: int, image_width: int | None = None) -> tuple[int, int]:
    """(rows, columns) of the input for DataConfig's two fields (also a checkpoint's meta and a
    model card, where models from before image_width have none: a square)."""
    return int(image_size), int(image_width or image_size)


Size = int | tuple[int, int]  # a square's side, or (rows, columns): DataConfig.input_hw


def as_hw(size: Size) -> tuple[int, int]:
    """(rows, columns) of a Size."""
    return (size, size) if isinstance(size, int) else (int(size[0]), int(size[1]))
