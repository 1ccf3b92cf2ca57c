"""Box annotations as masks (owner: data): Pascal VOC XML and YOLO text files found where
public sets keep them, filled in at the photo's size, carried as the mask channel, and
counted by the recipe, which then trains with pixel supervision; files that are not box
files (notes, damaged or hostile XML) are left alone."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from dtrain.data import boxes, mask_targets
from dtrain.data.config import DataConfig
from dtrain.data.datasets import open_split
from dtrain.recipe.decide import mask_supervision
from dtrain.recipe.stats import gather

W, H = 40, 20  # the photos: wider than tall, so a swapped axis shows


def _photo(path: Path, seed: int = 0) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(np.random.default_rng(seed).integers(40, 110, (H, W), dtype=np.uint8)).save(path)
    return path


def _voc(path: Path, box: tuple[int, int, int, int], size: tuple[int, int] = (W, H), name: str = "scratch") -> Path:
    """VOC's 1-based inclusive pixel corners (xmin, ymin, xmax, ymax)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    x0, y0, x1, y1 = box
    path.write_text(
        f"<annotation><filename>{path.stem}.jpg</filename><size><width>{size[0]}</width><height>{size[1]}</height>"
        f"<depth>1</depth></size><object><name>{name}</name><bndbox><xmin>{x0}</xmin><ymin>{y0}</ymin>"
        f"<xmax>{x1}</xmax><ymax>{y1}</ymax></bndbox></object></annotation>"
    )
    return path


def _marked(mask_path: Path, photo: Path, size=(H, W)) -> np.ndarray:
    with Image.open(photo) as img:
        native = (img.height, img.width)
    return mask_targets.read_mask(mask_path, size, native)[0].numpy() > 0


def test_a_voc_box_is_filled_in_where_its_pixels_are(tmp_path):
    photo = _photo(tmp_path / "a.png")
    # pixels 11..20 across, 3..8 down (1-based): columns 10..19 and rows 2..7 (0-based)
    marked = _marked(_voc(tmp_path / "a.xml", (11, 3, 20, 8)), photo)
    rows, cols = np.nonzero(marked)
    assert (rows.min(), rows.max(), cols.min(), cols.max()) == (2, 7, 10, 19)
    assert marked.sum() == 6 * 10


def test_a_voc_box_labelled_on_a_larger_copy_lands_on_the_same_place(tmp_path):
    photo = _photo(tmp_path / "a.png")
    marked = _marked(_voc(tmp_path / "a.xml", (21, 5, 40, 16), size=(2 * W, 2 * H)), photo)
    rows, cols = np.nonzero(marked)
    assert (rows.min(), rows.max(), cols.min(), cols.max()) == (2, 7, 10, 19)


def test_yolo_boxes_and_polygons_are_shares_of_the_photo(tmp_path):
    photo = _photo(tmp_path / "a.png")
    (tmp_path / "a.txt").write_text("0 0.25 0.5 0.5 0.5\n\n2 0.75 0.0 1.0 0.0 1.0 0.5\n")
    marked = _marked(tmp_path / "a.txt", photo)
    assert marked[5:15, 0:20].all() and not marked[:, 20:28].any() and not marked[:5, :20].any()  # the box
    assert marked[1, 38] and not marked[9, 31]  # the triangle in the top right corner
    shapes = boxes.read_shapes(tmp_path / "a.txt")
    assert len(shapes.boxes) == len(shapes.polygons) == 1


def test_the_mask_follows_the_photo_when_it_is_turned_and_resized(tmp_path):
    photo = _photo(tmp_path / "a.png")
    box = _voc(tmp_path / "a.xml", (1, 1, 20, 10))  # the top-left quarter
    marked = _marked(box, photo, size=(80, 40))  # an input standing upright: the photo is turned
    ref = mask_targets.resize_uint8(boxes.rasterise(boxes.read_shapes(box), H, W).mul(255), (80, 40))[0].numpy() > 0
    assert np.array_equal(marked, ref) and 0.2 < marked.mean() < 0.3


def test_neu_det_yolo_and_voc_layouts_pair_each_photo_with_its_box_file(tmp_path):
    neu = _photo(tmp_path / "neu" / "train" / "images" / "crazing" / "crazing_1.jpg")
    neu_box = _voc(tmp_path / "neu" / "train" / "annotations" / "crazing_1.xml", (1, 1, 5, 5))
    yolo = _photo(tmp_path / "yolo" / "images" / "train" / "x.png")
    yolo_box = tmp_path / "yolo" / "labels" / "train" / "x.txt"
    yolo_box.parent.mkdir(parents=True)
    yolo_box.write_text("1 0.5 0.5 0.2 0.2\n")
    voc = _photo(tmp_path / "voc" / "JPEGImages" / "y.png")
    voc_box = _voc(tmp_path / "voc" / "Annotations" / "y.xml", (2, 2, 4, 4))
    beside = _photo(tmp_path / "beside" / "dent" / "z.png")
    beside_box = _voc(tmp_path / "beside" / "dent" / "z.xml", (2, 2, 4, 4))
    notes = _photo(tmp_path / "notes" / "dent" / "n.png")
    (notes.parent / "n.txt").write_text("photographed on line 3, second shift\n")
    found = mask_targets.mask_files([str(p) for p in (neu, yolo, voc, beside, notes)])
    assert found == [str(neu_box), str(yolo_box), str(voc_box), str(beside_box), None]


def test_a_k_fold_runs_link_of_a_box_file_is_paired_with_the_photos_link(tmp_path):
    from dtrain.recipe.folds import link_split

    photo = _photo(tmp_path / "data" / "dent" / "a.png")
    box = _voc(tmp_path / "kept_apart" / "a.xml", (1, 1, 5, 5))  # the fold is given it: mask_files' answer
    link_split(tmp_path / "fold", "train", ["dent"], [str(photo)], [0], [str(box)])
    link = next((tmp_path / "fold" / "train" / "dent").glob("*.png"))
    found = mask_targets.mask_files([str(link)])[0]
    assert found is not None and Path(found).resolve() == box.resolve()


def test_a_mask_image_wins_over_a_box_file(tmp_path):
    photo = _photo(tmp_path / "dent" / "a.png")
    _voc(tmp_path / "dent" / "a.xml", (1, 1, 5, 5))
    Image.fromarray(np.zeros((H, W), np.uint8)).save(tmp_path / "dent" / "a_mask.png")
    assert mask_targets.mask_files([str(photo)]) == [str(tmp_path / "dent" / "a_mask.png")]


def test_a_voc_box_without_the_size_it_was_labelled_at_is_taken_in_the_photos_own_pixels(tmp_path):
    """Some converters write no <size> (or a zero one): the box then lands where its pixels say."""
    photo = _photo(tmp_path / "a.png")
    for i, size in enumerate(("", "<size><width>0</width><height>0</height></size>")):
        xml = tmp_path / f"a{i}.xml"
        xml.write_text(f"<annotation>{size}<object><name>x</name><bndbox><xmin>21</xmin><ymin>5</ymin><xmax>40</xmax>"
                       "<ymax>16</ymax></bndbox></object></annotation>")
        want = np.zeros((H, W), bool)
        want[4:16, 20:40] = True
        assert np.array_equal(_marked(xml, photo), want)
        assert boxes.marks(xml) is True


def test_what_a_box_file_marks(tmp_path):
    """An empty YOLO file (a good part in a detection set) marks nothing; notes mark nothing readable."""
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "one.txt").write_text("3 0.5 0.5 0.2 0.2\n")
    (tmp_path / "notes.txt").write_text("looked fine to me\n")
    assert (boxes.marks(tmp_path / "empty.txt"), boxes.marks(tmp_path / "one.txt")) == (False, True)
    assert boxes.marks(tmp_path / "notes.txt") is None and boxes.marks(tmp_path / "gone.txt") is None


@pytest.mark.parametrize("text", [
    "<annotation><object><name>x</name><bndbox><xmin>1</xmin></bndbox></object></annotation>",  # corners missing
    "<annotation><size><width>4",  # damaged
    "<?xml version='1.0'?><!DOCTYPE a [<!ENTITY e SYSTEM 'file:///etc/passwd'>]><annotation>&e;</annotation>",
    "<?xml version='1.0'?><!DOCTYPE a [" + "".join(
        f"<!ENTITY e{i} '{('&e' + str(i - 1) + ';') * 10 if i else 'lol'}'>" for i in range(10))
    + "]><annotation><size><width>&e9;</width></size></annotation>",  # an expansion bomb
    "<svg/>",
])
def test_xml_that_is_not_a_readable_voc_file_gives_no_mask(tmp_path, text):
    photo = _photo(tmp_path / "dent" / "a.png")
    (tmp_path / "dent" / "a.xml").write_text(text)
    assert not boxes.readable(tmp_path / "dent" / "a.xml")
    assert mask_targets.mask_files([str(photo)]) == [None]
    with pytest.raises(ValueError):
        boxes.read_shapes(tmp_path / "dent" / "a.xml")


@pytest.mark.parametrize("text", ["0 120 80 30 30\n", "0 0.5 0.5 0.1\n", "crack 0.5 0.5 0.1 0.1\n", "\xff\xfe"])
def test_text_that_is_not_yolo_gives_no_mask(tmp_path, text):
    _photo(tmp_path / "dent" / "a.png")
    (tmp_path / "dent" / "a.txt").write_bytes(text.encode("latin-1"))
    assert not boxes.readable(tmp_path / "dent" / "a.txt")


def test_an_oversized_box_file_is_not_opened(tmp_path):
    big = tmp_path / "a.txt"
    big.write_text("0 0.5 0.5 0.1 0.1\n" * (boxes.MAX_BYTES // 10))
    assert not boxes.readable(big)


def _neu_det(root: Path) -> None:
    """NEU-DET's layout: train/images/<class>/*.jpg, train/annotations/*.xml for all classes;
    val the same. A bright block on each photo, its box in the annotation."""
    for split, n in (("train", 4), ("validation", 2)):
        for c, cls in enumerate(("crazing", "inclusion")):
            for i in range(n):
                stem = f"{cls}_{i}"
                img = np.random.default_rng(10 * c + i).integers(40, 110, (H, W), dtype=np.uint8)
                x, y = 2 + 4 * i, 3 + 2 * c
                img[y:y + 6, x:x + 8] = 250
                (root / split / "images" / cls).mkdir(parents=True, exist_ok=True)
                Image.fromarray(img).save(root / split / "images" / cls / f"{stem}.png")
                _voc(root / split / "annotations" / f"{stem}.xml", (x + 1, y + 1, x + 8, y + 6), name=cls)


def test_the_recipe_trains_with_pixel_supervision_from_boxes_and_the_photos_carry_them(tmp_path):
    _neu_det(tmp_path)
    cfg = DataConfig(root=str(tmp_path), val_split="validation", test_split="", image_size=H, image_width=W)
    stats = gather(cfg)
    assert stats.masked_defects == stats.boxed_defects == 8 and stats.negative_class is None
    on = mask_supervision(stats)
    assert on.value == 1.0 and "8 of the 8 defective training photos have a mask (all of them boxes" in on.reason
    ds = open_split(cfg, "train", train=False, masks=True)
    for i, path in enumerate(ds.paths):
        pixels = ds._load(i)
        assert pixels.shape == (4, H, W)
        photo = np.asarray(Image.open(path))
        # the box is exactly the bright block: the mask channel marks it and nothing else
        assert np.array_equal(pixels[3].numpy() > 0, photo == 250)


@pytest.mark.parametrize("value", ["inf", "nan", "1e400", "-inf"])
def test_a_voc_file_with_a_coordinate_that_is_no_number_is_not_a_box_file(tmp_path, value):
    """float() reads these; an infinite edge stopped the mask's drawing with an OverflowError,
    which the data loader does not catch (a training run ended)."""
    path = tmp_path / "a.xml"
    path.write_text(f"<annotation><size><width>40</width><height>20</height></size><object><name>d</name><bndbox>"
                    f"<xmin>1</xmin><ymin>1</ymin><xmax>{value}</xmax><ymax>5</ymax></bndbox></object></annotation>")
    assert not boxes.readable(path)


def test_shapes_past_any_picture_mark_nothing_and_raise_nothing(tmp_path):
    # a size stated as a hair above zero: the shares overflow
    tiny = tmp_path / "a.xml"
    tiny.write_text("<annotation><size><width>1e-310</width><height>1e-310</height></size><object><name>d</name>"
                    "<bndbox><xmin>1</xmin><ymin>1</ymin><xmax>5</xmax><ymax>5</ymax></bndbox></object></annotation>")
    assert boxes.read_shapes(tiny).pixel_boxes == ((0.0, 0.0, 5.0, 5.0),)  # taken as the photo's own pixels
    labelme = tmp_path / "b.json"
    labelme.write_text('{"shapes": [{"shape_type": "rectangle", "points": [[1, 1], [1e10, 5]]}, {"shape_type": '
                       '"polygon", "points": [[1, 1], [1e300, 5], [3, 9]]}], "imageWidth": 1e-300, "imageHeight": 20}')
    assert boxes.rasterise(boxes.read_shapes(labelme), H, W).sum() == 0
    huge = boxes.Shapes(boxes=((0.1, 0.1, float("inf"), 0.5), (0.0, 0.0, 0.5, 0.5)), polygons=(((0, 0), (1e300, 0), (0, 1)),))
    marked = boxes.rasterise(huge, H, W)[0].numpy()
    assert marked.sum() == 10 * 20 and marked[:10, :20].all()  # the one drawable box
