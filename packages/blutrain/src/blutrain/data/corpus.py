"""The built-in corpus: this interpreter's own standard-library sources, byte-tokenized.

Every Python installation carries a few megabytes of real, varied, human-written text in its
standard library, so BluTrain can train a language model out of the box with no download. The
files are the ``*.py`` under ``sysconfig.get_paths()["stdlib"]``, sorted, without test directories,
``site-packages`` / ``dist-packages`` and empty files; a file holding a NUL byte (the byte
tokenizer's eot) or invalid UTF-8 is left out. On first use they are tokenized with
:class:`ByteTokenizer` into ``<cache>/stdlib-<python version>-<hash>`` — built in a temporary
directory and renamed into place, so an interrupted build never leaves a half cache — and later
calls return that directory.

The cap (:data:`DEFAULT_MAX_BYTES`, 16 MiB of text) holds the whole non-test stdlib of CPython
3.11–3.13 (about 12 MB: some 12 M tokens, enough for a small GPT-2 to train for a while without
repeating) while bounding disk use (2 bytes a token) and build time (about a second on two cores)
on an interpreter that carries more. Above the cap, files are taken in the order of the sha1 of
their path, so the sample spans the whole library instead of its alphabetical start.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import sysconfig
import tempfile
from pathlib import Path

from blutrain.data.errors import CorpusError
from blutrain.data.prepare import DATASET_FILE, PrepareReport, prepare
from blutrain.data.tokenizer import ByteTokenizer

DEFAULT_MAX_BYTES = 16 * 2**20
DEFAULT_VAL_FRACTION = 0.05
_FORMAT = 1  # bump when what goes into the cache changes, so old caches are not reused
_SKIP_DIRS = frozenset({"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"})


def cache_root() -> Path:
    """``$BLUTRAIN_CACHE_DIR``, else ``$XDG_CACHE_HOME/blutrain``, else ``~/.cache/blutrain``."""
    if os.environ.get("BLUTRAIN_CACHE_DIR"):
        return Path(os.environ["BLUTRAIN_CACHE_DIR"])
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]) / "blutrain"
    return Path.home() / ".cache" / "blutrain"


def stdlib_files() -> list[Path]:
    """The non-empty ``*.py`` files of the standard library outside test and site-packages
    directories, sorted by their path relative to the stdlib root."""
    root = Path(sysconfig.get_paths()["stdlib"])
    found: list[Path] = []
    for directory, subdirs, names in os.walk(root):
        subdirs[:] = sorted(d for d in subdirs if d not in _SKIP_DIRS)
        for name in names:
            path = Path(directory) / name
            if name.endswith(".py") and path.is_file() and path.stat().st_size > 0:
                found.append(path)
    return sorted(found, key=lambda p: p.relative_to(root).as_posix())


def select_files(files: list[Path], max_bytes: int, root: Path) -> list[Path]:
    """``files`` if they total at most ``max_bytes``; else those that fit when taken in the order of
    the sha1 of their path relative to ``root``, each kept only if it still fits. The result keeps
    the order of ``files``."""
    sizes = {p: p.stat().st_size for p in files}
    if sum(sizes.values()) <= max_bytes:
        return list(files)
    chosen: set[Path] = set()
    total = 0
    for path in sorted(
        files, key=lambda p: hashlib.sha1(p.relative_to(root).as_posix().encode()).hexdigest()
    ):
        if total + sizes[path] <= max_bytes:
            chosen.add(path)
            total += sizes[path]
    return [p for p in files if p in chosen]


def _is_clean_text(path: Path) -> bool:
    data = path.read_bytes()
    if b"\0" in data:
        return False
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def stdlib_corpus(
    cache_dir: Path | None = None,
    *,
    max_bytes: int = DEFAULT_MAX_BYTES,
    val_fraction: float = DEFAULT_VAL_FRACTION,
) -> PrepareReport:
    """Build the stdlib corpus on first use and describe it; its ``out_dir`` holds the shards.

    ``cache_dir`` defaults to :func:`cache_root`. The report's ``val_entropy_bits`` / ``_nats`` is
    the byte-unigram entropy of the validation split, the loss a trained model must beat.
    """
    if max_bytes < 1:
        raise CorpusError(f"stdlib_corpus: max_bytes must be >= 1, received {max_bytes}")
    root = cache_root() if cache_dir is None else Path(cache_dir)
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = select_files(stdlib_files(), max_bytes, stdlib)
    if not files:
        raise CorpusError(f"stdlib_corpus: no standard-library file fits in max_bytes={max_bytes}")
    key = hashlib.sha1(f"{_FORMAT}\n{max_bytes}\n{val_fraction!r}\n".encode())
    for path in files:
        key.update(f"{path.relative_to(stdlib).as_posix()}\t{path.stat().st_size}\n".encode())
    final = root / f"stdlib-{platform.python_version()}-{key.hexdigest()[:12]}"
    if (final / DATASET_FILE).is_file():
        return PrepareReport.read(final)

    root.mkdir(parents=True, exist_ok=True)
    building = Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".tmp", dir=root))
    try:
        documents = [p for p in files if _is_clean_text(p)]
        prepare(documents, building, ByteTokenizer(), val_fraction)
        (building / "files.txt").write_text(
            "".join(f"{p.relative_to(stdlib).as_posix()}\n" for p in documents)
        )
        try:
            building.rename(final)
        except OSError:
            # Another process finished the same build first; its result is identical.
            if not (final / DATASET_FILE).is_file():
                raise CorpusError(
                    f"stdlib_corpus: cache directory {final} exists but holds no {DATASET_FILE}; delete it"
                ) from None
    finally:
        shutil.rmtree(building, ignore_errors=True)
    return PrepareReport.read(final)
