"""A table of labels -> (photo, class, split) rows: the `csvlabels` layout's reader.

Plants export their inspection labels from a database or a labelling tool as a table, and
public sets ship one (VisA's `split_csv/1cls.csv`: object, split, label, image, mask). A
table names its columns in many ways, so they are found by what they hold:
- the file column: the one whose values name files under the data folder (paths relative
  to it or to the table, or bare file names when those are unique);
- the split column, if any: values that are all split names (train, val/valid/
  validation/dev, test); without one, a photo under ROOT/train/, ROOT/test/, ... is in
  that split;
- the label column: a column named as one (LABEL_NAMES), else the column with the fewest
  distinct values, at least two, of those left (a mask path or a free-text note has many).

A file listed twice under two labels, a listed file that does not exist, or a table with
no such columns is refused with what was found: a guess there would train on wrong labels.
Images under the folder that the table does not list are left out and counted.
"""

from __future__ import annotations

import csv
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from dtrain.errors import DtrainError

# Column names that say "the class"; compared lower-case, with spaces and '_' dropped.
LABEL_NAMES = ("label", "labels", "class", "classname", "classid", "category", "defect", "defecttype", "target", "y")
# Split names as imagefolder's folders are found (recipe/stats.VAL_NAMES), mapped to the role.
SPLIT_ROLES = {"train": "train", "training": "train", "val": "val", "valid": "val", "validation": "val", "dev": "val",
               "test": "test", "testing": "test"}
# Of several tables in the data folder, the one with this name (lower-case stem) holds the labels.
TABLE_NAMES = ("labels", "label", "annotations", "train", "classes")
# Rows read to choose the delimiter.
SNIFF_BYTES = 64 * 1024


@dataclass(frozen=True)
class Row:
    path: Path
    label: str
    split: str | None  # "train" / "val" / "test", or None when the table has no split column


@dataclass(frozen=True)
class Table:
    rows: list[Row]
    columns: tuple[str, str, str | None]  # the file, label and split columns' names, as the header has them
    unlisted: list[Path]  # images under the folder that no row names


def read(table: Path, root: Path, images: list[Path]) -> Table:
    """The rows of `table` for the photos `images` under `root` (what the folder holds, masks
    and debris already left out)."""
    header, records = _records(table)
    find = _finder(table, root, images)
    file_col = _file_column(header, records, find, table)
    if find(header[file_col]) is not None:  # no header: the first line is a photo's row too
        header, records = [f"column {i + 1}" for i in range(len(header))], [header, *records]
    split_col = _split_column(header, records, file_col)
    label_col = _label_column(header, records, {file_col, split_col}, table)
    rows: dict[Path, Row] = {}
    missing: list[str] = []
    for rec in records:
        value, label = rec[file_col].strip(), rec[label_col].strip()
        if not value or not label:  # an unlabelled row: the photo is left out as unlisted
            continue
        path = find(value)
        if path is None:
            missing.append(value)
            continue
        split = SPLIT_ROLES[rec[split_col].strip().lower()] if split_col is not None else _split_folder(path, root)
        row = Row(path, label, split)
        if path in rows and rows[path] != row:
            before = rows[path]
            what = (f"as {before.label!r} and {label!r}" if before.label != label
                    else f"in the {before.split} and the {split} split")
            raise DtrainError(
                f"{table} lists {value} twice, {what}",
                "keep one row per photo: dtrain trains one class per photo, in one split (for several defects on one "
                "part, label it by the one that decides its fate)",
            )
        rows[path] = row
    if missing:
        raise DtrainError(
            f"{table} lists {len(missing)} files that are not under {root}, e.g. {missing[0]}",
            "paths in the table are read relative to the data folder or to the table; fix them or copy the images in",
        )
    columns = header[file_col], header[label_col], None if split_col is None else header[split_col]
    return Table(list(rows.values()), columns, [p for p in images if p not in rows])


def _finder(table: Path, root: Path, images: list[Path]) -> Callable[[str], Path | None]:
    """A table's file value -> the photo it names: a path relative to the data folder or to the
    table (or an absolute one under the folder), else a bare file name no two photos share."""
    def keys(base: Path) -> dict[str, Path]:
        out = {}
        for p in images:
            try:
                out[str(p.relative_to(base)).replace("\\", "/").lower()] = p
            except ValueError:  # the table lies deeper than some photos
                pass
        return out

    by_rel, by_table_rel = keys(root), keys(table.parent)
    names: dict[str, list[Path]] = {}
    for p in images:
        names.setdefault(p.name.lower(), []).append(p)
    by_name = {n: ps[0] for n, ps in names.items() if len(ps) == 1}
    prefix = str(root).replace("\\", "/").lower().rstrip("/") + "/"

    def find(value: str) -> Path | None:
        key = value.strip().replace("\\", "/").lower()
        while key.startswith("./"):
            key = key[2:]
        if key.startswith(prefix):  # an absolute path under the data folder
            key = key[len(prefix):]
        return by_rel.get(key) or by_table_rel.get(key) or by_name.get(key.rsplit("/", 1)[-1])

    return find


def _split_folder(path: Path, root: Path) -> str | None:
    """The split a photo's top folder names (ROOT/train/..., ROOT/test/...), if any."""
    top = path.relative_to(root).parts[0].lower() if len(path.relative_to(root).parts) > 1 else ""
    return SPLIT_ROLES.get(top)


def _records(table: Path) -> tuple[list[str], list[list[str]]]:
    try:
        raw = table.read_bytes()
    except OSError as exc:
        raise DtrainError(f"cannot read the label table {table}: {exc}", "check the file's permissions") from None
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError:  # a spreadsheet's export on Windows: its code page, as Excel writes it
        text = raw.decode("cp1252", errors="replace")
    try:
        dialect = csv.Sniffer().sniff(text[:SNIFF_BYTES], delimiters=",;\t|")
    except csv.Error:
        dialect = csv.excel
    try:
        lines = [r for r in csv.reader(text.splitlines(), dialect) if any(c.strip() for c in r)]
    except csv.Error as exc:  # a field past csv's limit (128 KiB), or quoting it cannot read
        raise DtrainError(f"the label table {table} cannot be read as CSV: {exc}",
                          "one row per photo, its file and its class, e.g. file,label; save it again as plain CSV") from None
    if len(lines) < 2:
        raise DtrainError(f"the label table {table} has no rows", "one row per photo: its file and its class")
    width = len(lines[0])
    if width < 2 or any(len(r) != width for r in lines):
        raise DtrainError(f"the label table {table} does not have the same number (2 or more) of columns on every row",
                          "one row per photo, the header's columns on each, e.g. file,label")
    return [c.strip() for c in lines[0]], lines[1:]


def find_table(root: Path) -> Path | None:
    """The label table lying in `root` itself: its one .csv/.tsv file, or of several the one
    named as labels (TABLE_NAMES); None: none or no way to choose."""
    tables = sorted(p for p in root.iterdir() if p.suffix.lower() in (".csv", ".tsv") and p.is_file())
    if len(tables) == 1:
        return tables[0]
    named = [p for p in tables if p.stem.lower() in TABLE_NAMES]
    return named[0] if len(named) == 1 else None


def _file_column(header: list[str], records: list[list[str]], find, table: Path) -> int:
    hits = [sum(find(r[i]) is not None for r in records if r[i].strip()) for i in range(len(header))]
    best = max(range(len(header)), key=lambda i: hits[i])
    if hits[best] == 0:
        raise DtrainError(
            f"no column of {table} names the images under {table.parent} (columns: {', '.join(header)}; e.g. "
            f"{', '.join(records[0])})",
            "the table needs a column of file names or paths relative to the data folder",
        )
    return best


def _split_column(header: list[str], records: list[list[str]], file_col: int) -> int | None:
    for i in range(len(header)):
        values = {r[i].strip().lower() for r in records}
        if i != file_col and values <= set(SPLIT_ROLES) and "train" in {SPLIT_ROLES[v] for v in values}:
            return i
    return None


def _label_column(header: list[str], records: list[list[str]], taken: set[int | None], table: Path) -> int:
    left = [i for i in range(len(header)) if i not in taken]
    named = [i for i in left if header[i].lower().replace(" ", "").replace("_", "") in LABEL_NAMES]
    if named:
        return named[0]
    distinct = {i: len({r[i].strip() for r in records if r[i].strip()}) for i in left}
    usable = [i for i in left if distinct[i] >= 2]
    if not usable:
        raise DtrainError(f"no column of {table} holds two or more labels (columns: {', '.join(header)})",
                          "add a column with each photo's class, named label")
    return min(usable, key=lambda i: (distinct[i], i))
