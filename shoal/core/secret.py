"""The job's secret: the key that seals its store (:mod:`shoal.core.sealed`), proves a
joiner (:mod:`shoal.core.admission`) and signs a planning session's messages
(:class:`~shoal.core.trust.Seal`). One secret per job, from the first of:

1. shoal's own launcher: a fresh random one per job, handed to its processes in memory
   (:attr:`~shoal.core.env.Environment.secret`) or in their environment, never on a command
   line and never in the store;
2. :data:`SECRET_VAR` in the environment (hex, 16 bytes at least), as a user gives it to
   every rank of a torchrun, Slurm or mpirun job (they pass the environment on), or
   ``--secret-file PATH`` (an owner-only file holding the same; :func:`use_secret_file`);
   ``SHOAL_JOIN_SECRET``, its older name, is read too;
3. derived (:func:`derived_secret`) from this user's own key file
   (``~/.config/shoal/secret``, owner-only, made once) and the launcher's identity of the job,
   which every rank on this host, or on hosts that share the home folder, computes alike
   without the network. Across hosts rank 0 says in one line how to give one instead.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import logging
import os
import secrets
import stat
from pathlib import Path

from shoal.core.env import Environment
from shoal.core.files import describe_stat
from shoal.core.trust import SEAL_KEY_VAR
from shoal.errors import ShoalError

log = logging.getLogger("shoal.store")

#: The job's secret (hex), given by its user (or by a shoal process to those it starts).
SECRET_VAR = SEAL_KEY_VAR
#: The same, under its older name (a join secret under torchrun).
OLD_SECRET_VAR = "SHOAL_JOIN_SECRET"
#: The launcher's variables that tell one job from another on the same hosts.
JOB_IDENTITY = ("TORCHELASTIC_RUN_ID", "SLURM_JOB_ID", "SLURM_STEP_ID", "PMIX_NAMESPACE",
                "OMPI_MCA_ess_base_jobid", "OMPI_MCA_orte_ess_jobid", "PMI_KVSNAME")
MIN_BYTES = 16
HOW_TO_MAKE = "python -c 'import secrets; print(secrets.token_hex(32))' makes one"


def parse_secret(value: str, where: str) -> bytes:
    """The secret written as hex in ``value`` (surrounding blanks ignored), or a one-line
    error naming ``where`` it came from."""
    try:
        key = bytes.fromhex(value.strip())
    except ValueError:
        key = b""
    if len(key) < MIN_BYTES:
        raise ShoalError(f"{where} must be a secret of at least {2 * MIN_BYTES} hex digits, the "
                         f"same for every rank and shoal join ({HOW_TO_MAKE})")
    return key


def given_secret() -> bytes | None:
    """The secret in :data:`SECRET_VAR` (or :data:`OLD_SECRET_VAR`), ``None`` when neither is
    set; a one-line error when it is not one."""
    for name in (SECRET_VAR, OLD_SECRET_VAR):
        value = os.environ.get(name)
        if value is not None:
            return parse_secret(value, name)
    return None


def _read_own(path: Path, what: str) -> bytes:
    """The contents of ``path``, a regular file of this user's that nobody else may read or
    write (never through a link), or a one-line error."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise ShoalError(f"cannot read {what} {path}: {exc.strerror}") from None
    st = os.fstat(fd)  # before a file object: a folder's would not open
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
        os.close(fd)
        raise ShoalError(f"{what} {path} is not a file of yours that only you can read "
                         f"({describe_stat(st)}): chmod 600 it")
    with os.fdopen(fd, "rb") as f:
        return f.read(4096)


def use_secret_file(path: str | Path) -> None:
    """``--secret-file PATH``: the secret in ``path`` (hex, an owner-only file) becomes this
    process's :data:`SECRET_VAR`, and so that of every process it starts.

    Raises:
        ShoalError: the file is not owner-only, or holds no secret.
    """
    if not str(path):
        raise ShoalError("--secret-file needs a file name")
    raw = _read_own(Path(path), "--secret-file")
    key = parse_secret(raw.decode(errors="replace"), f"--secret-file {path}")
    os.environ[SECRET_VAR] = key.hex()


def user_key_path() -> Path:
    """This user's own key file, the root of the secrets derived here."""
    config = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return Path(config) / "shoal" / "secret"


def user_key() -> bytes:
    """The key in :func:`user_key_path`, made once (32 random bytes, mode 0600, linked into
    place whole so that ranks starting together read the same), refused in one line when it
    is not owner-only."""
    path = user_key_path()
    if not path.exists() and not path.is_symlink():
        try:
            path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            _make_key(path)
        except OSError as exc:
            raise ShoalError(f"cannot make the key file {path} ({exc.strerror}) that seals the "
                             f"job's store: give a secret in {SECRET_VAR} or --secret-file "
                             f"({HOW_TO_MAKE})") from None
    key = _read_own(path, "the key file")
    if len(key) < 32:
        raise ShoalError(f"the key file {path} holds {len(key)} bytes, not 32: remove it "
                         "(shoal makes a new one)")
    return key


def _make_key(path: Path) -> None:
    """Write a new key to ``path`` unless one is there (whole: written aside, then linked)."""
    temp = path.with_name(f".secret-{secrets.token_hex(8)}")
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(secrets.token_bytes(32))
            f.flush()
            os.fsync(f.fileno())
        with contextlib.suppress(FileExistsError):  # another rank made it first: theirs
            os.link(temp, path)
    finally:
        temp.unlink(missing_ok=True)


def derived_secret(env: Environment) -> bytes:
    """The secret every rank of ``env``'s job derives alike: an HMAC under :func:`user_key`
    of the launcher's identity of the job (its run, job or step id where it has one, the
    store's address)."""
    parts = [f"{name}={os.environ.get(name, '')}" for name in JOB_IDENTITY]
    parts += [f"launcher={env.launcher}", f"store={env.master_addr}:{env.master_port}"]
    return hmac.new(user_key(), "\n".join(parts).encode(), hashlib.sha256).digest()


def job_secret(env: Environment) -> bytes:
    """The secret of ``env``'s job (see the module's docstring).

    Raises:
        ShoalError: a given secret is not one, or the key file cannot be used.
    """
    if env.secret is not None:
        return parse_secret(env.secret, "the launcher's secret")
    given = given_secret()
    if given is not None:
        return given
    key = derived_secret(env)
    if env.rank == 0 and env.world_size != env.local_world_size:
        log.warning(f"shoal: the job's store is sealed with a secret derived from "
                    f"{user_key_path()}, which only hosts that share it derive alike: give every "
                    f"rank the same {SECRET_VAR} or --secret-file where they do not")
    return key
