"""dtrain data push / verify / info against a local folder and a real S3 API (moto
server on loopback, authentication on): resumable push, corruption found by name,
one-line errors for a missing bucket and wrong credentials."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

from dtrain.data.config import DataConfig
from dtrain.data.shard_format import MANIFEST
from dtrain.data.shard_push import KILL_AFTER_ENV, parse_size, plan_shards, push
from dtrain.data.shard_verify import data_fingerprint, info, load_manifest, verify
from dtrain.data.shards import open_shard_split
from dtrain.data.storage import open_store
from dtrain.errors import DtrainError

SHARD = "100kB"  # ~25 images per shard: a dozen shards from the small set


def run_cli(args, env=None, timeout=120):
    full_env = dict(os.environ, **(env or {}))
    return subprocess.run([sys.executable, "-m", "dtrain", *args], capture_output=True, text=True,
                          env=full_env, timeout=timeout)


def test_plan_and_size_parsing():
    assert parse_size("256MB") == 256_000_000 and parse_size("1GiB") == 2**30 and parse_size("4096") == 4096
    with pytest.raises(DtrainError):
        parse_size("lots")
    # ranges cover every id once, in order; an oversized image gets a shard of its own
    ranges = plan_shards([100, 100, 5000, 100, 100, 100], 2600)
    assert ranges[0][0] == 0 and ranges[-1][1] == 6
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    assert (2, 3) in ranges


def test_push_local_verify_info_and_webdataset_reads_it(synth_data, tmp_path):
    dest = tmp_path / "pushed"
    report = push(DataConfig(root=str(synth_data)), open_store(str(dest)), parse_size(SHARD))
    manifest = load_manifest(open_store(str(dest)))
    assert report.shards_total > 10 and not report.shards_skipped
    src_counts = {s: len(list((synth_data / s).rglob("*.png"))) for s in ("train", "val", "test")}
    assert {k: v.count for k, v in manifest.splits.items()} == src_counts
    summary = info(open_store(str(dest)))
    assert summary["splits"]["train"]["class_counts"]["ok"] == len(list((synth_data / "train" / "ok").glob("*.png")))
    assert verify(open_store(str(dest))).ok
    assert data_fingerprint(str(dest)) == summary["fingerprint"]

    # The shards are plain WebDataset tars: the webdataset library reads them, and the
    # image members are the source files' original bytes (no re-encoding).
    import webdataset as wds

    paths = sorted(str(p) for p in (dest / "train").glob("shard-*.tar"))
    seen = 0
    rel = json.loads((dest / manifest.splits["train"].paths.name).read_text())
    for sample in wds.WebDataset(paths, shardshuffle=False, empty_check=False):
        i = int(sample["__key__"])
        assert sample["png"] == (synth_data / rel[i]).read_bytes()
        assert int(sample["cls"]) == manifest.classes.index(Path(rel[i]).parent.name)
        seen += 1
    assert seen == manifest.splits["train"].count


@pytest.mark.slow
def _copy_set(synth_data, dest: Path) -> Path:
    shutil.copytree(synth_data, dest)
    return dest


def test_photo_names_that_are_not_utf8_push_and_read_back(synth_data, tmp_path):
    # A Windows zip unpacked here names its files in cp1252 bytes; such a photo is pushed,
    # verified and read back like any other, under its own name.
    src = _copy_set(synth_data, tmp_path / "src")
    ok = os.fsencode(src / "val" / "ok")
    first = sorted(os.listdir(ok))[0]
    os.rename(ok + b"/" + first, ok + b"/d\xe9faut.png")
    dest = tmp_path / "pushed"
    push(DataConfig(root=str(src)), open_store(str(dest)), parse_size(SHARD))
    assert verify(open_store(str(dest))).ok
    assert info(open_store(str(dest)))["splits"]["val"]["count"] == len(list((src / "val").rglob("*.png")))
    data = open_shard_split(DataConfig(root=str(dest)), "val", train=False)
    i = data.paths.index(os.path.join("val", "ok", os.fsdecode(b"d\xe9faut.png")))
    with open(ok + b"/d\xe9faut.png", "rb") as fh:
        assert data.fetch([i])[0] == fh.read()
    assert data[i] is not None  # and decodes


def test_a_class_name_that_is_not_utf8_is_refused_before_anything_is_pushed(synth_data, tmp_path):
    # Before: the push went through and its manifest could not be read back ("lone leading
    # surrogate"); a training run from the folder met the name only in its report's plots.
    src = _copy_set(synth_data, tmp_path / "src")
    for split in ("train", "val", "test"):
        os.rename(os.fsencode(src / split / "stain"), os.fsencode(src / split) + b"/t\xe2che")
    dest = tmp_path / "pushed"
    with pytest.raises(DtrainError, match=r"the class name b't\\xe2che' in .* is not UTF-8 text") as err:
        push(DataConfig(root=str(src)), open_store(str(dest)), parse_size(SHARD))
    assert "convmv" in str(err.value) and not (dest / MANIFEST).exists()
    res = run_cli(["data", "push", str(src), str(dest)])
    assert res.returncode != 0 and "is not UTF-8 text" in res.stderr and "Traceback" not in res.stderr


def test_a_set_without_a_test_folder_pushes_the_splits_it_has(synth_data, tmp_path):
    src = _copy_set(synth_data, tmp_path / "src")
    shutil.rmtree(src / "test")
    dest = tmp_path / "pushed"
    push(DataConfig(root=str(src)), open_store(str(dest)), parse_size(SHARD))
    assert sorted(load_manifest(open_store(str(dest))).splits) == ["train", "val"]


def test_a_mask_labelled_set_without_a_test_folder_pushes_the_splits_it_has(synth_data, tmp_path):
    # masklabels reads split folders of photos beside their masks; an absent one is skipped
    # as imagefolder's is (only other errors stop the push).
    import numpy as np
    from PIL import Image

    src = tmp_path / "src"
    for split in ("train", "val"):
        (src / split).mkdir(parents=True)
        for cls in ("ok", "scratch"):
            for i, photo in enumerate(sorted((synth_data / split / cls).glob("*.png"))[:6]):
                shutil.copy(photo, src / split / f"{cls}{i}.png")
                mask = np.zeros((32, 32), np.uint8)
                mask[8:12, 8:20] = 255 if cls == "scratch" else 0
                Image.fromarray(mask).save(src / split / f"{cls}{i}_mask.png")
    dest = tmp_path / "pushed"
    push(DataConfig(root=str(src), layout="masklabels"), open_store(str(dest)), parse_size(SHARD))
    manifest = load_manifest(open_store(str(dest)))
    assert sorted(manifest.splits) == ["train", "val"] and manifest.splits["train"].count == 12


def test_interrupted_push_resumes_without_reupload(synth_data, s3_server, monkeypatch, tmp_path):
    for k, v in s3_server.env().items():
        monkeypatch.setenv(k, v)
    bucket = s3_server.new_bucket()
    dest = f"s3://{bucket}/defects"
    args = ["data", "push", str(synth_data), dest, "--shard-size", SHARD]
    killed = run_cli(args, env={KILL_AFTER_ENV: "3"})
    assert killed.returncode == -9, killed.stderr  # really killed mid-push
    s3 = s3_server.client()
    objects = {o["Key"]: o for o in s3.list_objects_v2(Bucket=bucket)["Contents"]}
    finished = sorted(k for k in objects if k.endswith(".tar.sha256"))
    assert len(finished) == 3 and f"defects/{MANIFEST}" not in objects
    with pytest.raises(DtrainError, match="no pushed data set"):
        load_manifest(open_store(dest))
    before = {k[:-7]: (objects[k[:-7]]["ETag"], objects[k[:-7]]["LastModified"]) for k in finished}
    time.sleep(1.1)  # S3 LastModified has 1 s resolution: a rewrite would show

    done = push(DataConfig(root=str(synth_data)), open_store(dest), parse_size(SHARD))
    assert sorted(done.shards_skipped) == sorted(k.split("/", 1)[1] for k in before)
    assert len(done.shards_uploaded) == done.shards_total - 3 and done.bytes_per_s > 0
    objects = {o["Key"]: o for o in s3.list_objects_v2(Bucket=bucket)["Contents"]}
    for key, (etag, modified) in before.items():
        assert (objects[key]["ETag"], objects[key]["LastModified"]) == (etag, modified), key

    # A corrupted shard is named by verify (CLI exit non-zero), and --recheck repairs it.
    victim = sorted(k for k in objects if k.endswith(".tar"))[5]
    body = bytearray(s3.get_object(Bucket=bucket, Key=victim)["Body"].read())
    body[700] ^= 0xFF
    s3.put_object(Bucket=bucket, Key=victim, Body=bytes(body))
    bad = run_cli(["data", "verify", dest])
    assert bad.returncode != 0
    assert victim.split("/", 1)[1] in bad.stdout and "sha256 mismatch" in bad.stdout
    assert bad.stdout.count("BAD ") == 1  # everything the resumed push wrote is intact
    assert "Traceback" not in bad.stderr
    fixed = push(DataConfig(root=str(synth_data)), open_store(dest), parse_size(SHARD), recheck=True)
    assert fixed.shards_uploaded == [victim.split("/", 1)[1]]
    assert verify(open_store(dest)).ok


@pytest.mark.slow
def test_missing_bucket_and_wrong_credentials_are_one_line_errors(synth_data, s3_server, tmp_path):
    missing = run_cli(["data", "push", str(synth_data), "s3://no-such-bucket-dtrain/x"], env=s3_server.env())
    assert missing.returncode != 0 and "Traceback" not in missing.stderr
    first = missing.stderr.strip().splitlines()[0]
    assert "s3://no-such-bucket-dtrain/x" in first and "bucket does not exist" in first

    bucket = s3_server.new_bucket()
    wrong_secret = s3_server.env(AWS_SECRET_ACCESS_KEY="not-the-secret-0123456789")
    unknown_key = s3_server.env(AWS_ACCESS_KEY_ID="AKIADOESNOTEXIST0000")
    for argv, env in ((["data", "push", str(synth_data), f"s3://{bucket}/x"], wrong_secret),
                      (["data", "info", f"s3://{bucket}/x"], unknown_key)):
        out = run_cli(argv, env=env)
        assert out.returncode != 0 and "Traceback" not in out.stderr
        first = out.stderr.strip().splitlines()[0]
        assert f"s3://{bucket}/x" in first and "access denied" in first
        for secret in ("not-the-secret-0123456789", s3_server.secret, s3_server.key):
            assert secret not in out.stderr + out.stdout


def test_fingerprint_differs_for_different_data(synth_data, tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    push(DataConfig(root=str(synth_data)), open_store(str(a)), parse_size("1MB"), splits=["train"])
    push(DataConfig(root=str(synth_data)), open_store(str(b)), parse_size("1MB"), splits=["val"])
    assert data_fingerprint(str(a)) != data_fingerprint(str(b))
    # a re-push of the same source is byte-identical: same fingerprint
    push(DataConfig(root=str(synth_data)), open_store(str(tmp_path / "c")), parse_size("1MB"), splits=["train"])
    assert data_fingerprint(str(tmp_path / "c")) == data_fingerprint(str(a))
    with tarfile.open(next((a / "train").glob("shard-000000-*.tar"))) as tar:
        assert all(m.mtime == 0 for m in tar.getmembers())


def _changed_copy(src: Path, dest: Path) -> Path:
    """`src` with a few train images changed (bytes appended: same pixels, new content)."""
    shutil.copytree(src, dest)
    for path in sorted((dest / "train").rglob("*.png"))[::40]:
        with open(path, "ab") as fh:
            fh.write(b"changed")
    return dest


@pytest.mark.slow  # ~10 CLI runs against moto
def test_interrupted_repush_of_changed_data_keeps_the_old_version(synth_data, s3_server, tmp_path, monkeypatch):
    env = s3_server.env()
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    dest = f"s3://{s3_server.new_bucket()}/defects"
    first = run_cli(["data", "push", str(synth_data), dest, "--shard-size", SHARD, "--split", "train"], env=env)
    assert first.returncode == 0, first.stderr
    old = run_cli(["data", "info", dest, "--json"], env=env)
    changed = _changed_copy(synth_data, tmp_path / "changed")

    staging = tmp_path / "tmp"
    staging.mkdir()
    env["TMPDIR"] = str(staging)
    killed = run_cli(["data", "push", str(changed), dest, "--shard-size", SHARD, "--split", "train"], env={**env, KILL_AFTER_ENV: "2"})
    assert killed.returncode == -9, killed.stderr  # really killed mid-push, new shards already written
    assert len(list(staging.iterdir())) == 1  # what a SIGKILL leaves; the next push removes it
    check = run_cli(["data", "verify", dest], env=env)
    assert check.returncode == 0, check.stdout + check.stderr
    assert run_cli(["data", "info", dest, "--json"], env=env).stdout == old.stdout  # same version, same fingerprint

    done = run_cli(["data", "push", str(changed), dest, "--shard-size", SHARD, "--split", "train"], env=env)
    assert done.returncode == 0, done.stderr
    assert "earlier versions remain" in done.stdout
    assert list(staging.iterdir()) == []
    assert run_cli(["data", "verify", dest], env=env).returncode == 0
    new_info = run_cli(["data", "info", dest, "--json"], env=env).stdout
    assert new_info != old.stdout
    store = open_store(dest)
    manifest = load_manifest(store)
    rel = json.loads(store.read_bytes(manifest.splits["train"].paths.name))
    ds = open_shard_split(DataConfig(root=dest, cache_dir=str(tmp_path / "cache")), "train", train=False)
    i = next(i for i, r in enumerate(rel) if (changed / r).read_bytes().endswith(b"changed"))
    assert ds.fetch([i])[0] == (changed / rel[i]).read_bytes()  # readers get the new version

    # gc removes what the manifest no longer names, and nothing it names.
    listed = set(store.list_sizes(""))
    removed = run_cli(["data", "gc", dest], env=env)
    assert removed.returncode == 0, removed.stderr
    left = set(store.list_sizes(""))
    gone = {line.split(" ", 1)[1] for line in removed.stdout.splitlines() if line.startswith("removed ")}
    assert gone and gone == listed - left
    named = {s.name for sp in manifest.splits.values() for s in sp.shards}
    assert {n for n in left if n.endswith(".tar")} == named
    assert run_cli(["data", "verify", dest], env=env).returncode == 0

