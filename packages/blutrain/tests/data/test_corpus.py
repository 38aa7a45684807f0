"""The built-in corpus: the interpreter's stdlib sources, byte-tokenized into a cache."""

from __future__ import annotations

import math
import platform
import sysconfig
from pathlib import Path

import numpy as np
import pytest

from blutrain.data import TokenLoader, cache_root, read_shard, stdlib_corpus
from blutrain.data.corpus import select_files, stdlib_files

SMALL = 200_000  # bytes of text: enough files to be a corpus, quick to build in a test


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("BLUTRAIN_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_corpus_is_built_in_blutrain_cache_dir(cache: Path) -> None:
    report = stdlib_corpus(max_bytes=SMALL)
    assert report.out_dir.parent == cache
    assert report.out_dir.name.startswith(f"stdlib-{platform.python_version()}-")
    assert report.train_shards and report.val_shards


def test_corpus_shards_are_the_listed_stdlib_files_with_eot_before_each(cache: Path) -> None:
    report = stdlib_corpus(max_bytes=SMALL)
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    names = (report.out_dir / "files.txt").read_text().splitlines()
    expected = b"".join(b"\x00" + (stdlib / n).read_bytes() for n in names)
    shards = np.concatenate([read_shard(p) for p in report.train_shards + report.val_shards])
    assert shards.astype(np.uint8).tobytes() == expected
    assert report.documents == len(names)


def test_corpus_text_stays_within_max_bytes(cache: Path) -> None:
    report = stdlib_corpus(max_bytes=SMALL)
    assert 0.5 * SMALL < report.text_bytes <= SMALL


def test_corpus_second_call_reuses_the_cache(cache: Path) -> None:
    first = stdlib_corpus(max_bytes=SMALL)
    stamp = first.train_shards[0].stat().st_mtime_ns
    second = stdlib_corpus(max_bytes=SMALL)
    assert second == first
    assert second.train_shards[0].stat().st_mtime_ns == stamp


def test_corpus_build_leaves_only_the_final_directory(cache: Path) -> None:
    report = stdlib_corpus(max_bytes=SMALL)
    assert [p.name for p in cache.iterdir()] == [report.out_dir.name]


def test_corpus_reports_val_byte_entropy_in_bits_and_nats(cache: Path) -> None:
    report = stdlib_corpus(max_bytes=SMALL)
    val = np.concatenate([read_shard(p) for p in report.val_shards])
    p = np.bincount(val, minlength=256) / len(val)
    reference = -sum(float(q) * math.log(float(q)) for q in p if q > 0)
    assert report.val_entropy_nats == pytest.approx(reference, rel=1e-12)
    assert report.val_entropy_bits == pytest.approx(reference / math.log(2), rel=1e-12)
    assert report.val_entropy_bits is not None
    assert 2.0 < report.val_entropy_bits < 8.0  # source code: far from uniform, far from constant


def test_corpus_cache_dir_argument_overrides_the_environment(cache: Path, tmp_path: Path) -> None:
    report = stdlib_corpus(tmp_path / "elsewhere", max_bytes=SMALL)
    assert report.out_dir.parent == tmp_path / "elsewhere"
    assert not cache.exists()


def test_corpus_train_split_feeds_a_loader_with_byte_vocabulary(cache: Path) -> None:
    report = stdlib_corpus(max_bytes=SMALL)
    x, y = TokenLoader(report.train_pattern, 4, 64, vocab_size=256).next_batch()
    assert x[0, 0] == 0  # the stream opens with the eot before the first file
    np.testing.assert_array_equal(x[:, 1:], y[:, :-1])


def test_stdlib_files_skip_test_directories_and_site_packages() -> None:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = stdlib_files()
    parts = {part for f in files for part in f.relative_to(stdlib).parts[:-1]}
    assert not parts & {"test", "tests", "idle_test", "site-packages", "dist-packages"}
    assert stdlib / "os.py" in files
    assert all(f.suffix == ".py" for f in files)


def test_stdlib_files_are_sorted_by_relative_path() -> None:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    names = [f.relative_to(stdlib).as_posix() for f in stdlib_files()]
    assert names == sorted(names)


def test_capped_selection_is_deterministic_and_spread_over_the_library() -> None:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = stdlib_files()
    chosen = select_files(files, SMALL, stdlib)
    assert chosen == select_files(files, SMALL, stdlib)
    assert sum(f.stat().st_size for f in chosen) <= SMALL
    top_dirs = {f.relative_to(stdlib).parts[0] for f in chosen if len(f.relative_to(stdlib).parts) > 1}
    assert len(top_dirs) >= 3  # not just the alphabetical start


def test_cache_root_is_blutrain_cache_dir_when_set(cache: Path) -> None:
    assert cache_root() == cache


def test_cache_root_defaults_to_home_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("BLUTRAIN_CACHE_DIR", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert cache_root() == tmp_path / ".cache" / "blutrain"
