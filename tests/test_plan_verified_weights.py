"""Loading a plan hashes its (multi-GB) weights once: a verified checksum is recorded beside them
(weights.verified.json, also by the build, which hashed the file while writing it) and later loads
trust it while the file stays as it was. Any change to the file (its bytes, times, inode) brings
the full check back, and a plan in a read-only directory still loads."""

from __future__ import annotations

import os
import shutil
import stat
import tempfile

import pytest

import kvtool.plan.load
from kvtool.errors import PlanError
from kvtool.plan import BuildOptions, build_plan, load_plan

RECORD = "weights.verified.json"


@pytest.fixture
def hashes(monkeypatch):
    """The files load_plan hashed, in order."""
    hashed = []
    real = kvtool.plan.load.file_checksum

    def counting(path):
        hashed.append(path.name)
        return real(path)

    monkeypatch.setattr(kvtool.plan.load, "file_checksum", counting)
    return hashed


@pytest.fixture
def plan_dir(tmp_path):
    return build_plan("preset:tiny-llama", tmp_path / "plan", BuildOptions(tokens_per_block=16, max_seq_len=512))


def flip_a_byte_in_place(path):
    """Changes the file's content but not its size or inode (what a bit flip or a careless tool does)."""
    with open(path, "r+b") as f:
        f.seek(-5, os.SEEK_END)
        byte = f.read(1)
        f.seek(-5, os.SEEK_END)
        f.write(bytes([byte[0] ^ 0xFF]))


def test_the_weights_are_hashed_once_then_trusted_while_unchanged(plan_dir, hashes):
    assert (plan_dir / RECORD).is_file()  # the build recorded the checksum it computed while writing
    load_plan(plan_dir)
    hashes.clear()
    for _ in range(3):
        assert load_plan(plan_dir).path == plan_dir
    assert hashes == []


def test_weights_modified_in_place_with_the_same_size_are_refused(plan_dir, hashes):
    load_plan(plan_dir)
    weights = plan_dir / "weights.safetensors"
    before = weights.stat()
    flip_a_byte_in_place(weights)
    assert weights.stat().st_size == before.st_size and weights.stat().st_ino == before.st_ino
    for _ in range(2):  # a refused file is never recorded as verified
        with pytest.raises(PlanError, match="does not match its recorded checksum.*rebuild"):
            load_plan(plan_dir)
    assert "weights.safetensors" in hashes


def test_weights_modified_with_their_times_set_back_are_refused(plan_dir):
    load_plan(plan_dir)
    weights = plan_dir / "weights.safetensors"
    before = weights.stat()
    flip_a_byte_in_place(weights)
    os.utime(weights, ns=(before.st_atime_ns, before.st_mtime_ns))  # mtime as recorded (ctime moves on)
    with pytest.raises(PlanError, match="does not match its recorded checksum"):
        load_plan(plan_dir)


def test_touched_weights_are_hashed_again_and_still_load(plan_dir, hashes):
    load_plan(plan_dir)
    hashes.clear()
    os.utime(plan_dir / "weights.safetensors")
    load_plan(plan_dir)
    assert hashes == ["weights.safetensors"]
    hashes.clear()
    load_plan(plan_dir)  # verified again, so trusted again
    assert hashes == []


def test_a_copied_plan_is_hashed_again(plan_dir, tmp_path, hashes):
    load_plan(plan_dir)
    copy = shutil.copytree(plan_dir, tmp_path / "copy")  # same size and mtime, another inode
    hashes.clear()
    load_plan(copy)
    assert hashes == ["weights.safetensors"]


def test_a_record_for_another_checksum_or_an_unreadable_record_is_not_trusted(plan_dir, hashes):
    record = plan_dir / RECORD
    record.write_text(record.read_text().replace('"checksum": "', '"checksum": "0'))
    hashes.clear()
    load_plan(plan_dir)
    assert hashes == ["weights.safetensors"]
    record.write_text("{not json")
    hashes.clear()
    load_plan(plan_dir)
    assert hashes == ["weights.safetensors"]


def test_skipping_the_checksum_neither_hashes_nor_records(plan_dir, hashes):
    (plan_dir / RECORD).unlink()
    load_plan(plan_dir, verify_checksum=False)
    assert hashes == [] and not (plan_dir / RECORD).exists()


def test_a_plan_in_a_read_only_directory_loads_and_is_checked(plan_dir, hashes, monkeypatch):
    (plan_dir / RECORD).unlink()
    mode = plan_dir.stat().st_mode
    plan_dir.chmod(stat.S_IRUSR | stat.S_IXUSR)
    if os.access(plan_dir, os.W_OK):  # root writes anyway: make creating files there fail as a read-only mount does
        def refuse(*args, **kwargs):
            raise PermissionError(30, "Read-only file system")

        monkeypatch.setattr(tempfile, "mkstemp", refuse)
    try:
        for _ in range(2):
            assert load_plan(plan_dir).path == plan_dir
        assert hashes == ["weights.safetensors"] * 2  # nothing recorded, so each load hashes
        assert sorted(path.name for path in plan_dir.iterdir()) == ["plan.json", "tokenizer", "weights.safetensors"]
        flip_a_byte_in_place(plan_dir / "weights.safetensors")
        with pytest.raises(PlanError, match="does not match its recorded checksum"):
            load_plan(plan_dir)
    finally:
        plan_dir.chmod(mode)
