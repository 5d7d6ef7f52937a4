"""Where ``shoal join`` finds a running elastic job: ``OUT/.shoal-join/job.json``.

shoal's launcher of a ``--elastic`` job publishes (:func:`publish`) its store's loopback
address, the job's join secret, its own pid, the job's size and bound, and its settings,
in a file made fresh (``atomic_write``: a new owner-only file renamed into place) in a
folder only its user can enter (:func:`~shoal.core.trust.private_dir`), and takes it away
when the job ends (:func:`withdraw`). ``shoal join`` trusts the file only when the folder
and the file are its user's own, not links, and readable by nobody else (:func:`read_job`);
every other case is one line naming it: no job, a finished one, one without ``--elastic``.

Under torchrun there is no launcher of shoal's to make the secret: its user gives the same
one to every rank and to ``shoal join`` in :data:`JOIN_SECRET_VAR` (:func:`join_secret`; the
secret that seals the job's store, :mod:`shoal.core.secret`), and
rank 0's keeper publishes the job file without it (the torchrun store's address and the
attempt's key prefix; the keeper's pid stands for the launcher's), and the same document in
the job's store, signed with the secret (:func:`publish_in_store`), for a joiner on a host
that does not see ``--out`` (``shoal join --store HOST:PORT``: :func:`read_job_in_store`
trusts it only when its own secret checks the signature). Without the variable, a torchrun
job takes no joiners.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
from datetime import timedelta
from pathlib import Path
from typing import Any

from shoal.config import TrainConfig
from shoal.core.descendants import pid_alive
from shoal.core.files import atomic_write, describe_stat
from shoal.core.secret import SECRET_VAR, given_secret
from shoal.core.trust import Seal, check_private_dir, open_own, private_dir
from shoal.errors import ShoalError

FOLDER, NAME = ".shoal-join", "job.json"
#: A torchrun job's document in its store (:func:`publish_in_store`), and what its tag signs.
STORE_KEY, _SIGNED = "shoal/job", b"shoal-job"
#: Under torchrun: the job's secret, hex (16 bytes at least), given to every rank and to
#: ``shoal join`` by their user: the one that seals the job's store (:mod:`shoal.core.secret`).
JOIN_SECRET_VAR = SECRET_VAR
MAX_BYTES = 1 << 20  # a job file is a few kB; anything larger is not one of shoal's
MAX_WORKER_ID = 1 << 31  # a worker id becomes a rank (a C int in torch.distributed)


def join_secret() -> str | None:
    """The job's secret (hex) its user gave in :data:`JOIN_SECRET_VAR` (or its older name),
    ``None`` when unset; a one-line error when it is too short or not hex."""
    key = given_secret()
    return None if key is None else key.hex()


def publish(cfg: TrainConfig, port: int, key: str | None, workers: int, *,
            address: str = "127.0.0.1", attempt: int = 0, first_id: int | None = None) -> None:
    """Write the job file of ``cfg``'s job: its store on ``address``:``port`` (keys under
    ``attempt``'s prefix), its secret ``key`` (hex; ``None``: its user gives it in
    :data:`JOIN_SECRET_VAR`), ``workers`` at the start and at most ``cfg.max_workers``
    (default: ``workers``); ``first_id``: the first joiner's worker id (default
    ``workers``; past every earlier joiner's in a resumed asynchronous job)."""
    folder = private_dir(Path(cfg.out) / FOLDER, "the join folder")
    job = _document(cfg, (address, port), key, workers, attempt, first_id)
    atomic_write(folder / NAME, lambda f: f.write(json.dumps(job).encode()), "join file")


def _document(cfg: TrainConfig, store: tuple[str, int], key: str | None, workers: int,
              attempt: int, first_id: int | None = None) -> dict[str, Any]:
    return {"store": list(store), "key": key, "attempt": attempt, "launcher": os.getpid(),
            "workers": workers, "max_workers": cfg.max_workers or workers,
            "first_id": workers if first_id is None else first_id, "config": cfg.to_dict()}


def withdraw(out: Path) -> None:
    """Take the job file away (the job ended); the folder too once empty."""
    folder = Path(out) / FOLDER
    (folder / NAME).unlink(missing_ok=True)
    with contextlib.suppress(OSError):  # not there, or holds something: left as it is
        folder.rmdir()


def publish_in_store(store: Any, cfg: TrainConfig, address: str, port: int, key: str,
                     workers: int, attempt: int, first_id: int | None = None) -> None:
    """Put a torchrun job's document (as :func:`publish` writes it, without the secret) in
    its store under :data:`STORE_KEY`, signed with the join secret ``key`` (hex): a joiner on
    a host that does not see ``--out`` finds it there (``shoal join --store``) and trusts
    only what its own secret checks."""
    raw = json.dumps(_document(cfg, (address, port), None, workers, attempt, first_id)).encode()
    tag = Seal(bytes.fromhex(key)).tag(_SIGNED, raw).hex()
    store.set(STORE_KEY, json.dumps({"job": raw.decode(), "tag": tag}))


def read_job_in_store(store: Any, host: str, port: int) -> dict[str, Any]:
    """The job document in the store at ``host``:``port``, checked against the secret in
    :data:`JOIN_SECRET_VAR`, or a one-line error."""
    key, where = join_secret(), f"{host}:{port}"
    if key is None:
        raise ShoalError(f"shoal join --store needs the job's secret in {JOIN_SECRET_VAR} (the "
                         "one its ranks have)")
    if not store.check([STORE_KEY]):
        raise ShoalError(f"the store at {where} holds no shoal job that takes joiners under the "
                         f"secret in {JOIN_SECRET_VAR} (another job's secret? its ranks need "
                         "the same; rank 0 says where it takes joiners)")
    raw = store.get(STORE_KEY)
    try:
        signed = json.loads(raw) if len(raw) <= MAX_BYTES else None
        doc, tag = str(signed["job"]).encode(), bytes.fromhex(str(signed["tag"]))
        good = Seal(bytes.fromhex(key)).check(tag, _SIGNED, doc)
    except (ValueError, TypeError, KeyError):
        raise ShoalError(f"the job document in the store at {where} is not shoal's") from None
    if not good:
        raise ShoalError(f"the job in the store at {where} is not signed with the secret in "
                         f"{JOIN_SECRET_VAR} (another job's secret?); not trusted")
    job = _checked(json.loads(doc), f"the job document in the store at {where}")
    return {**job, "address": host, "port": port, "key": key}


def withdraw_from_store(store: Any) -> None:
    """Take the job's document out of its store (the job ended), if the store is still up."""
    with contextlib.suppress(Exception):
        store.set_timeout(timedelta(seconds=2))  # a store gone is not waited for
        store.delete_key(STORE_KEY)


def read_job(out: Path) -> dict[str, Any]:
    """The job file of the job running in ``out``, checked, or a one-line error."""
    out = Path(out)
    if not out.is_dir():
        raise ShoalError(f"{out} is not a folder (shoal join takes a running job's --out)")
    folder = out / FOLDER
    if not os.path.lexists(folder / NAME) and not os.path.islink(folder):
        raise ShoalError(_no_job(out))
    check_private_dir(folder, "the join folder")
    fd = open_own(folder / NAME)
    try:
        st = os.fstat(fd)
        if stat.S_IMODE(st.st_mode) & 0o077:
            raise ShoalError(f"{folder / NAME} is readable or writable by others "
                             f"({describe_stat(st)}): shoal did not write it so; not trusted")
        raw = os.read(fd, MAX_BYTES + 1)
    finally:
        os.close(fd)
    try:
        job = json.loads(raw) if len(raw) <= MAX_BYTES else None
    except ValueError:
        job = None
    checked = _checked(job, str(folder / NAME))
    if not pid_alive(checked["launcher"]):
        raise ShoalError(f"no running job in {out}: its launcher (pid {checked['launcher']}) "
                         "is gone")
    if checked["key"] is None:
        checked["key"] = _given_secret(out)
    return checked


def _checked(job: Any, what: str) -> dict[str, Any]:
    """The fields of a job document read back, each of its type, or a one-line error."""
    try:
        config = TrainConfig.from_dict(job["config"])
        address, port = job["store"]
        key, workers = job["key"], int(job["workers"])
        first_id = int(job.get("first_id", workers))
        if not workers <= first_id < MAX_WORKER_ID:
            raise ValueError(first_id)
        return {"address": str(address), "port": int(port),
                "key": None if key is None else str(key), "attempt": int(job.get("attempt", 0)),
                "launcher": int(job["launcher"]), "workers": workers,
                "first_id": first_id, "max_workers": int(job["max_workers"]), "config": config}
    except (ValueError, TypeError, KeyError, ShoalError):
        raise ShoalError(f"{what} is not a job file of shoal's") from None


def _given_secret(out: Path) -> str:
    """The secret of a job torchrun, srun or mpirun started, as the user gives it to
    ``shoal join``."""
    key = join_secret()
    if key is None:
        raise ShoalError(f"the job in {out} runs under torchrun, srun or mpirun: give shoal join "
                         f"the secret its ranks have, in {JOIN_SECRET_VAR}")
    return key


def _no_job(out: Path) -> str:
    """Why ``out`` holds no job to join."""
    if (out / "summary.json").is_file():
        return f"the job in {out} has finished (it wrote summary.json); there is nothing to join"
    try:
        elastic = json.loads((out / "config.json").read_text()).get("elastic")
    except (OSError, ValueError, AttributeError):
        elastic = None
    if elastic is False:
        return f"the job in {out} was started without --elastic: it takes no joiners"
    return f"no running elastic job in {out} (no {FOLDER}/{NAME} there)"
