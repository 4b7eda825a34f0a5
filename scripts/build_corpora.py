"""Build the three comparison corpora, bit for bit, from sources any Debian or Ubuntu machine with
Python can get, and check every file against the sha256 written below.

    python scripts/build_corpora.py                      # english, python and docs into corpora/
    python scripts/build_corpora.py --out DIR --corpora docs
    python scripts/build_corpora.py --check              # verify corpora/ without rebuilding

Each corpus is NAME_train.bin and NAME_valid.bin: raw bytes, every source file prefixed by one byte
0, the files in sorted order. run.py and compare.py take them as `--data NAME_train.bin --valid_data
NAME_valid.bin` (compare.py finds the _valid file beside the _train one by itself).

- english: Vim's help files, /usr/share/vim/vim90/doc/*.txt from Debian 12's vim-runtime
  2:9.0.1378 (`apt-get install vim-runtime`). Train is the first 99% of the bytes, valid the rest.
- python: the running Python's standard library .py files, exactly as run.py's `--data stdlib`
  concatenates them, split exactly as `--data stdlib --validation_batch_size 64` splits them (the
  last max(128, 1%) bytes are valid), so both see the same bytes. The hashes below are Python
  3.11.7's; another version's standard library differs, and the script then refuses unless given
  --allow_other_versions, which writes the files anyway (their hashes are printed, not checked).
- docs: English technical documentation with markup, held out from every choice of the project's
  defaults: the .txt, .rst and .md files under the documentation folder of seven pinned source
  archives from PyPI (immutable files, each checked against its published sha256 before use).
  Archives are kept in OUT/downloads/, so a rebuild is offline. 99% / 1% split as english.

A file is only written once all of its corpus's hashes match, under a temporary name then renamed,
so a mismatch or a kill never leaves a half-written or wrong corpus under the real name. The exit
code is 0 when every corpus asked for was written (or, with --check, matched), 1 otherwise.
"""

from __future__ import annotations

import hashlib
import io
import os
import sys
import tarfile
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import tyro

ROOT = Path(__file__).resolve().parent.parent  # the repository root, where run.py is

CORPORA = ("english", "python", "docs")


@dataclass(frozen=True)
class Args:
    out: str = "corpora"
    """folder that gets NAME_train.bin and NAME_valid.bin (and docs' downloads/)"""
    corpora: tuple[str, ...] = CORPORA
    """which corpora to build or check: english, python, docs"""
    check: bool = False
    """only verify the files already in --out against the expected hashes; build nothing"""
    allow_other_versions: bool = False
    """write the python corpus even when its hashes differ (another Python's standard library): they
    are printed, and the mismatch is a warning, not a failure"""


# ------------------------------------------------------------------------------------------------
# Expected results: (size in bytes, sha256) of every file, and the versions of the sources.

EXPECTED = {
    "english_train.bin": (
        9_424_515,
        "860f2390010948529ac984d35ce9ccf1071b4050c186997733b6aab9bf4bc9b3",
    ),
    "english_valid.bin": (
        95_198,
        "55faa6ff8f931c338f59dbd66db35fa4e9708d2b65185fd8a32d80a8b7634f46",
    ),
    "python_train.bin": (
        31_211_744,
        "674a547e84a6863542c3d58ec68fa9405537fce43482396584798ef767c8927c",
    ),
    "python_valid.bin": (
        315_270,
        "f04daf29709d1d051259b0a6079b2de5a1b6684ee0920b1b42cb5e507d986bdd",
    ),
    "docs_train.bin": (
        17_938_512,
        "31e1292643a5b9a5424e9a1160f40a44ca93bd311af715d5df0fa6c7d2876029",
    ),
    "docs_valid.bin": (181_198, "6132f8cac5c2e3f67b84c464146bd395cc8ac1a154be822299eb32898cbe45fd"),
}

VIM_DOC = Path("/usr/share/vim/vim90/doc")
VIM_VERSION = "Debian 12's vim-runtime 2:9.0.1378"
VIM_FILES = 151  # its doc/*.txt: 9,519,713 bytes with the 0 bytes
# its standard library: 1,790 .py files, 31,527,014 bytes with the 0 bytes
PYTHON_VERSION = (3, 11, 7)

# Source archives of the docs corpus, in the corpus's order: (file name, documentation folder inside
# it, sha256 as PyPI publishes it, URL). The folder is relative to the archive's top folder
# (NAME-VERSION/); within an archive the files are sorted by their path.
PYPI = "https://files.pythonhosted.org/packages"
DOCS_ARCHIVES = (
    (
        "ansible-core-2.12.10.tar.gz",
        "docs",
        "feb1df61738cfc1f5e893b42a2ec1a7de32977d67e86707b45eb63d0c5c3c236",
        f"{PYPI}/e5/55/02da87b26d98a76a95bc8ef4df0ecff73cb73eb5b89ae5f2576b51785acb/ansible-core-2.12.10.tar.gz",
    ),
    (
        "celery-5.3.6.tar.gz",
        "docs",
        "870cc71d737c0200c397290d730344cc991d13a057534353d124c9380267aab9",
        f"{PYPI}/99/72/45a2d2f9b45ccc6e80e2168ce169d17bf06a98711c192d7b53d5a8accf77/celery-5.3.6.tar.gz",
    ),
    (
        "Django-4.2.11.tar.gz",
        "docs",
        "6e6ff3db2d8dd0c986b4eec8554c8e4f919b5c1ff62a5b4390c17aff2ed6e5c4",
        f"{PYPI}/d2/e2/c0e7586dd4db1140be179b1386346d1b2e2570dfc7c0d1c0343bdf0d43b0/Django-4.2.11.tar.gz",
    ),
    (
        "sphinx-7.2.6.tar.gz",
        "doc",
        "9a5160e1ea90688d5963ba09a2dcd8bdd526620edbb65c328728f1b2228d5ab5",
        f"{PYPI}/73/8e/6e51da4b26665b4b92b1944ea18b2d9c825e753e19180cc5bdc818d0ed3b/sphinx-7.2.6.tar.gz",
    ),
    (
        "SQLAlchemy-2.0.29.tar.gz",
        "doc",
        "bd9566b8e58cabd700bc367b60e90d9349cd16f0984973f98a9a09f9c64e86f0",
        f"{PYPI}/99/04/59971bfc2f192e3b52376ca8d1e134c78d04bc044ef7e04cf10c42d2ce17/SQLAlchemy-2.0.29.tar.gz",
    ),
    (
        "sympy-1.12.tar.gz",
        "doc",
        "ebf595c8dac3e0fdc4152c51878b498396ec7f30e7a914d6071e674d49420fb8",
        f"{PYPI}/e5/57/3485a1a3dff51bfd691962768b14310dae452431754bfc091250be50dd29/sympy-1.12.tar.gz",
    ),
    (
        "twisted-24.3.0.tar.gz",
        "docs",
        "6b38b6ece7296b5e122c9eb17da2eeab3d98a198f50ca9efd00fb03e5b4fd4ae",
        f"{PYPI}/fc/8d/9c09d75173984d3b0f0dcf65d885fe61a06de11db2c30b1196d85f631cfc/twisted-24.3.0.tar.gz",
    ),
)
DOCS_SUFFIXES = (".txt", ".rst", ".md")

TRAIN_SHARE = 0.99  # english and docs: train is the first int(0.99 * len) bytes, valid the rest
STDLIB_VALIDATION_BATCH = 64  # python: split as run.py splits --data stdlib with this batch
STDLIB_VALID_FRACTION = 0.01  # and run.py's default --valid_fraction


class SourceError(Exception):
    """A source that is missing or not the version hashed here: printed as one line."""


# ------------------------------------------------------------------------------------------------
# Files and hashes


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def join_documents(documents) -> bytes:
    """Every document prefixed by one byte 0 (run.py's document separator), in the order given."""
    return b"".join(b"\0" + document for document in documents)


def split_share(data: bytes) -> tuple[bytes, bytes]:
    cut = int(TRAIN_SHARE * len(data))
    return data[:cut], data[cut:]


def write_atomic(path: Path, data: bytes) -> None:
    """Write under a hidden temporary name, fsync, then rename: a kill never leaves a partial file
    under the real name."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def report(name: str, size: int, digest: str, verdict: str) -> None:
    print(f"{name:18} {size:>11,} bytes  sha256 {digest}  {verdict}")


# ------------------------------------------------------------------------------------------------
# The three corpora: each returns {file name: bytes} and what to blame when its hashes differ.


def english() -> tuple[dict[str, bytes], str]:
    files = sorted(VIM_DOC.glob("*.txt"))
    if not files:
        raise SourceError(
            f"english: no {VIM_DOC}/*.txt; install them with `apt-get install vim-runtime`"
        )
    train, valid = split_share(join_documents(f.read_bytes() for f in files))
    count = f"{len(files)} files" + (f", not {VIM_FILES}" if len(files) != VIM_FILES else "")
    blame = f"the Vim help files in {VIM_DOC} ({count}) are not {VIM_VERSION}'s"
    return {"english_train.bin": train, "english_valid.bin": valid}, blame


def python() -> tuple[dict[str, bytes], str]:
    sys.path.insert(0, str(ROOT))
    from egg import corpus  # its two functions define --data stdlib's bytes

    data = join_documents(
        f.read_bytes() for f in corpus.corpus_files(corpus.stdlib_folder(), ".py")
    )
    # run.py's split of --data stdlib (open_data): the last max(2 * batch, 1%) bytes are validation
    held_out = max(2 * STDLIB_VALIDATION_BATCH, int(len(data) * STDLIB_VALID_FRACTION))
    version = ".".join(map(str, sys.version_info[:3]))
    expected = ".".join(map(str, PYTHON_VERSION))
    blame = (
        f"this Python's standard library ({version}, {corpus.stdlib_folder()}) is not {expected}'s"
    )
    if sys.version_info[:3] != PYTHON_VERSION:
        blame = f"the hashes are Python {expected}'s standard library, and this is Python {version}"
    return {"python_train.bin": data[:-held_out], "python_valid.bin": data[-held_out:]}, blame


def download(url: str, path: Path, expected: str) -> bytes:
    """The archive at `path`, downloaded first if absent; its sha256 checked either way."""
    if not path.exists():
        print(f"downloading {url}")
        path.parent.mkdir(parents=True, exist_ok=True)
        with urllib.request.urlopen(url, timeout=120) as response:
            write_atomic(path, response.read())
    data = path.read_bytes()
    if sha256(data) != expected:
        raise SourceError(
            f"docs: {path} has sha256 {sha256(data)}, not PyPI's {expected}: a broken or different "
            "download; delete it and run again"
        )
    return data


def documentation(archive: bytes, folder: str) -> list[tuple[str, bytes]]:
    """(path, bytes) of each regular .txt/.rst/.md file under TOP/folder/ of a .tar.gz archive."""
    documents = []
    with tarfile.open(fileobj=io.BytesIO(archive), mode="r:gz") as tar:
        for member in tar.getmembers():
            _, _, inside = member.name.partition("/")  # drop the archive's top folder NAME-VERSION/
            if (
                member.isfile()
                and inside.startswith(folder + "/")
                and inside.endswith(DOCS_SUFFIXES)
            ):
                documents.append((member.name, tar.extractfile(member).read()))
    return documents


def docs(out: Path) -> tuple[dict[str, bytes], str]:
    documents = []
    for name, folder, digest, url in DOCS_ARCHIVES:
        found = sorted(documentation(download(url, out / "downloads" / name, digest), folder))
        print(
            f"{name:30} {folder + '/':6} {len(found):4} files "
            f"{sum(len(d) for _, d in found):>11,} bytes"
        )
        documents += found
    train, valid = split_share(join_documents(data for _, data in documents))
    blame = (
        "the archives matched, so their files were read or ordered differently "
        "(a change to this script?)"
    )
    return {"docs_train.bin": train, "docs_valid.bin": valid}, blame


# ------------------------------------------------------------------------------------------------
# Build and check


def build(name: str, args: Args) -> bool:
    """Build one corpus; write its files only if all of them match (or if allowed). True:
    written."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    files, blame = {"english": english, "python": python, "docs": lambda: docs(out)}[name]()
    matched = True
    for file, data in files.items():
        size, expected = EXPECTED[file]
        ok = (len(data), sha256(data)) == (size, expected)
        matched &= ok
        report(file, len(data), sha256(data), "ok" if ok else f"DIFFERS (expected {expected})")
    allowed = name == "python" and args.allow_other_versions
    if not matched and not allowed:
        print(f"error: {name}: {blame}; nothing written")
        return False
    if not matched:
        print(f"warning: {name}: {blame}; written anyway (--allow_other_versions)")
    for file, data in files.items():
        write_atomic(out / file, data)
    return True


def check(name: str, args: Args) -> bool:
    """Verify one corpus's files in --out without rebuilding. True: all present and matching."""
    matched = True
    for file in (f"{name}_train.bin", f"{name}_valid.bin"):
        path = Path(args.out) / file
        size, expected = EXPECTED[file]
        if not path.exists():
            print(f"{file:18} missing from {args.out}")
            matched = False
            continue
        digest = file_sha256(path)
        ok = (path.stat().st_size, digest) == (size, expected)
        matched &= ok
        report(file, path.stat().st_size, digest, "ok" if ok else f"DIFFERS (expected {expected})")
    return matched


def main(args: Args) -> int:
    unknown = set(args.corpora) - set(CORPORA)
    if unknown:
        print(f"error: --corpora: unknown {sorted(unknown)}; choose from {', '.join(CORPORA)}")
        return 2
    matched = True
    for name in args.corpora:
        try:
            matched &= (check if args.check else build)(name, args)
        except SourceError as error:
            print(f"error: {error}")
            matched = False
    return 0 if matched else 1


if __name__ == "__main__":
    sys.exit(main(tyro.cli(Args, use_underscores=True)))
