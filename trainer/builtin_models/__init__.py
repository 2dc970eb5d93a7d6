"""The built-in base models (tiny-arith, tiny-calc), shipped built and installed by a verified copy.

Their recipes (``trainer.builtin_models.tiny_arith``, ``trainer.builtin_models.tiny_calc``) train them from scratch in
two to four minutes on two cores. Rather than have every new machine spend that on its first run (and the demo, the
suite and a service each build their own), the project ships the files of one such build in this package
(``tiny-arith/``, ``tiny-calc/``), with each file's SHA-256 recorded in :data:`DIGESTS`. Installing a model is copying
those files into the model store and checking every digest: well under a second.

Shipping the build also gives every machine the same weights. A build from scratch is deterministic on one kind of
machine, but where the CPU has fast bf16 matmuls the recipe trains under bf16 autocast, whose rounding depends on the
CPU's kernels, so a build on another kind of CPU is another model. The learning tests and the README's figures are
calibrated on the shipped build; ``build_info.json`` says how and where it was made, and ``proxima models build NAME
--from-scratch`` trains one again and says whether it reproduced these bytes.

Torch-free: ``proxima serve`` installs the offered built-in models from the API's process.
"""

from __future__ import annotations

import dataclasses
import hashlib
import shutil
import tempfile
from pathlib import Path
from typing import Literal

from trainer.spec.names import BUILTIN_MODELS

SHIPPED = Path(__file__).resolve().parent
MARKER = "build_info.json"
"""Written last into a build and copied last into an install: a folder holding it is complete."""
WEIGHTS = "model.safetensors"

# Each shipped file's SHA-256. A changed file needs its digest changed here in the same commit (the unit test of the
# shipped copies fails otherwise), so a model can only change by a reviewed edit of this table.
DIGESTS: dict[str, dict[str, str]] = {
    "tiny-arith": {
        "build_info.json": "db4b96139e6d9a49487384b6cfb080dfe839e55adaa42ed76585239987cba038",
        "chat_template.jinja": "1284e439e6499eb8b8cfc9c88cab33a30fa34839a50e6b5dfc6d6d7b1e4d73a2",
        "config.json": "b87b0897920918c28c24f7d18bda0f1f0978367053d5bdb51031828f66ed493e",
        "generation_config.json": "823f3d59a8537faee18d7dbfcbc3f46ee99d685662735e4a385125b5b1311c6a",
        "model.safetensors": "52ad223f2c9327e13042b66ce8b59de8e2ba2b04bf3173395fc6780ff92112c8",
        "tokenizer.json": "99c0f8b8c52a70d4d49bb8405df83c3a0d7b0ea607ca76e80bab4d037f556f1d",
        "tokenizer_config.json": "7230349ecba75badd7b3920a9f1b7037f25578668d5e7c7a61cf60a3ec215e39",
    },
    "tiny-calc": {
        "build_info.json": "b7dd811a962fad46d10ed7757f0241fd698415dd5245abb73d94967a24911ac9",
        "chat_template.jinja": "b41f3f01c0228de0b9b966b77b632440e7aeedf42ef5a23f1ba8cf7f7494b0ce",
        "config.json": "7dae28ca05e7e131678313b8c66242ba8fd65440ab7c28fdb3dcc6898fce6bef",
        "generation_config.json": "823f3d59a8537faee18d7dbfcbc3f46ee99d685662735e4a385125b5b1311c6a",
        "model.safetensors": "7e0e21f0db63428d9f1caee8aef67a6a7cc6ae06b56ef8270544229c0dff7ef8",
        "tokenizer.json": "c19136c6f8fd20bc0773c82ee55a05ac102d6e802f312743a4fe7033d4e64fd5",
        "tokenizer_config.json": "7230349ecba75badd7b3920a9f1b7037f25578668d5e7c7a61cf60a3ec215e39",
    },
}


class BuiltinModelError(ValueError):
    """A built-in model that cannot be installed as asked (names the model and the file)."""


Outcome = Literal["installed", "present", "kept"]


@dataclasses.dataclass(frozen=True)
class Installed:
    """Where a built-in model is in the model store, and what :func:`install` did to put it there.

    ``installed``: copied from the shipped build now; ``present``: the store already held the shipped build;
    ``kept``: the store holds another complete build of that name (one made from scratch here, or a release's older
    one), left in place because adapters trained on it need it (``replace=True`` installs the shipped one instead).
    """

    name: str
    path: Path
    outcome: Outcome
    weights_sha256: str


def is_complete_build(path: Path) -> bool:
    """True when ``path`` holds a finished build: the marker is written last, just before the rename."""
    return (path / MARKER).is_file()


def refuse_foreign_directory(out_dir: Path) -> None:
    """Builds appear by rename, so a non-empty directory without the marker is not ours: never delete it."""
    if out_dir.is_dir() and any(out_dir.iterdir()):
        raise FileExistsError(f"{out_dir} exists, is not empty and holds no {MARKER}")
    if out_dir.exists() and not out_dir.is_dir():
        raise FileExistsError(f"{out_dir} exists and is not a directory")


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def folder_digests(folder: Path) -> dict[str, str]:
    """Every regular file directly in ``folder`` → its SHA-256."""
    return {p.name: file_sha256(p) for p in sorted(folder.iterdir()) if p.is_file()}


def differences(expected: dict[str, str], actual: dict[str, str]) -> list[str]:
    """The file names whose digests differ, or that one side lacks, sorted."""
    return sorted(name for name in expected.keys() | actual.keys() if expected.get(name) != actual.get(name))


def _digests(name: str) -> dict[str, str]:
    if name not in BUILTIN_MODELS:
        raise BuiltinModelError(f"unknown built-in model {name!r}; valid: {', '.join(BUILTIN_MODELS)}")
    return DIGESTS[name]


def shipped(name: str) -> Path:
    """The shipped build of ``name``, every file checked against :data:`DIGESTS` (a changed or missing file is an
    error naming it: a copy of the project that lost or altered a model must not train on it unnoticed)."""
    expected = _digests(name)
    folder = SHIPPED / name
    actual = folder_digests(folder) if folder.is_dir() else {}
    if bad := differences(expected, actual):
        raise BuiltinModelError(f"the shipped build of {name} in {folder} does not match its digests: {', '.join(bad)}")
    return folder


def is_shipped_build(folder: Path, name: str) -> bool:
    """Whether ``folder`` holds exactly the shipped build of ``name``."""
    return folder.is_dir() and not differences(_digests(name), folder_digests(folder))


def install(name: str, store: Path, *, replace: bool = False) -> Installed:
    """Put the shipped build of ``name`` into ``store/name`` (see :class:`Installed` for the outcomes).

    The files are copied into a temporary sibling, the marker last, checked against their digests there and renamed
    into place, so the folder in the store is absent or complete; several processes may install at once (the first
    rename wins, the others find it complete). A non-empty folder without the marker is not ours and is never
    touched."""
    source = shipped(name)
    expected = _digests(name)
    target = store / name
    if is_complete_build(target):
        actual = folder_digests(target)
        if not differences(expected, actual):
            return Installed(name, target, "present", expected[WEIGHTS])
        if not replace:
            return Installed(name, target, "kept", actual.get(WEIGHTS, ""))
        shutil.rmtree(target)
    else:
        try:
            refuse_foreign_directory(target)
        except FileExistsError as err:
            raise BuiltinModelError(f"{err}: not a model build, left alone") from None
    store.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=store))
    try:
        tmp.chmod(0o755)  # mkdtemp makes 0700; models are shared with workers and other users
        for file in sorted(expected, key=lambda f: f == MARKER):
            shutil.copyfile(source / file, tmp / file)
            (tmp / file).chmod(0o644)
        if bad := differences(expected, folder_digests(tmp)):
            raise BuiltinModelError(f"the copy of {name} in {store} does not match its digests: {', '.join(bad)}")
        try:
            if target.is_dir() and not any(target.iterdir()):
                target.rmdir()
            tmp.rename(target)
        except OSError:
            if not is_shipped_build(target, name):  # another process's install wins only if it is ours too
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return Installed(name, target, "installed", expected[WEIGHTS])


def install_missing(names: list[str], store: Path) -> list[Installed]:
    """Install each built-in model among ``names`` that the store lacks (other names are not ours); what was put
    there now. A store folder holding another build is left as it is."""
    done = []
    for name in names:
        if name in BUILTIN_MODELS and not is_complete_build(store / name):
            done.append(install(name, store))
    return done
