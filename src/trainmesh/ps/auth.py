"""Who may talk to a parameter server: the job's shared secret, and what happens to strangers.

Every server authenticates every frame (an HMAC-SHA256 made with the job's secret, see
``protocol.py``), loopback ones included; only an in-process server (tests) may run without.

* The secret: ``secret=``, else ``TRAINMESH_PS_SECRET``, else the file named by
  ``TRAINMESH_PS_SECRET_FILE`` (which must be the user's own and unreadable by anyone else,
  mode 0600). When the user gives none, ``trainmesh run --servers``, ``LocalCluster`` and
  ``ParameterServerStrategy`` make a random one per job (``new_secret``) and hand it only to the
  job's own processes (their environment, or the process group); ``python -m trainmesh.ps``
  writes the one it makes to a 0600 file and logs the path.
* A frame that fails authentication (or is not a frame at all) is never parsed further. The
  server answers it with a small unsigned *rejection* (a fixed text, nothing echoed; at most
  one per peer per ``reply_interval_s``), so a client with a wrong or missing secret is told at
  once instead of timing out. A stranger gains nothing from a rejection: it only says "no".
  The client reads it only as "fail what is pending on that server" (``PSAuthError``), with
  its own text: a forged rejection can do no more than a dropped connection.
* Rejections are logged at most once per peer per ``log_interval_s``, with a count, and at most
  ``max_log_lines`` lines per interval in all: a flood of bad frames is a few log lines.
"""

from __future__ import annotations

import logging
import os
import secrets
import stat
import tempfile
import time
from dataclasses import dataclass
from typing import Callable, Mapping

from .protocol import Message, MessageType, ProtocolError, _check_secret, encode
from .frame_decode import decode
from .transport import SECRET_ENV  # the shared secret itself

SECRET_FILE_ENV = "TRAINMESH_PS_SECRET_FILE"  # or the path of a 0600 file holding it
# Rejection codes: the frame's HMAC was missing or wrong / the bytes were not a frame at all.
UNAUTHENTICATED, MALFORMED = "unauthenticated", "malformed"
_REJECTION_MAX_BYTES = 4096


def new_secret() -> str:
    """A random secret for one job (256 bits, URL-safe text so it fits an environment variable)."""
    return secrets.token_urlsafe(32)


def resolve_secret(secret: bytes | str | None = None, environ: Mapping[str, str] | None = None) -> bytes | None:
    """``secret`` if given, else ``TRAINMESH_PS_SECRET``, else the file ``TRAINMESH_PS_SECRET_FILE``
    names; None when there is none. Raises ValueError for an empty secret or an unsafe file."""
    if secret is not None:
        return _check_secret(secret)
    env = os.environ if environ is None else environ
    if env.get(SECRET_ENV):
        return _check_secret(env[SECRET_ENV])
    if env.get(SECRET_FILE_ENV):
        return read_secret_file(env[SECRET_FILE_ENV])
    return None


def as_text(secret: bytes | str) -> str:
    """The secret as text, for a child's environment."""
    if isinstance(secret, str):
        return secret
    try:
        return bytes(secret).decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError(
            "a secret handed to other processes must be UTF-8 text "
            "(use trainmesh.ps.auth.new_secret()). Received: undecodable bytes"
        ) from None


def read_secret_file(path: str | os.PathLike) -> bytes:
    """The secret in ``path``: a regular file of this user's that nobody else may read or write."""
    path = os.fspath(path)
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except OSError as error:
        raise ValueError(
            f"cannot read the parameter-server secret file ({error}). Received: {SECRET_FILE_ENV}={path}"
        ) from None
    with os.fdopen(fd, "rb") as fh:
        info = os.fstat(fh.fileno())
        if not stat.S_ISREG(info.st_mode):
            raise ValueError(f"the parameter-server secret file must be a regular file. Received: {path}")
        if hasattr(os, "getuid") and info.st_uid != os.getuid():
            raise ValueError(
                f"the parameter-server secret file belongs to another user (uid {info.st_uid}). Received: {path}"
            )
        if info.st_mode & 0o077:
            raise ValueError(
                f"the parameter-server secret file is open to other users (mode "
                f"{stat.S_IMODE(info.st_mode):04o}); run `chmod 600 {path}`. Received: {path}"
            )
        value = fh.read().strip()
    if not value:
        raise ValueError(f"the parameter-server secret file is empty. Received: {path}")
    return value


def write_secret_file(secret: bytes | str, path: str | os.PathLike | None = None) -> str:
    """Write ``secret`` to a new file only this user can read (mode 0600) and return its path:
    ``path`` (which must not exist yet), or ``secret`` in a new private temporary directory."""
    if path is None:
        path = os.path.join(tempfile.mkdtemp(prefix="trainmesh-ps-"), "secret")  # a 0700 directory
    path = os.fspath(path)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(as_text(secret).encode("utf-8") + b"\n")
    return path


# -- the rejection answer -------------------------------------------------------------------


def rejection_frame(server_id: str, code: str) -> bytes:
    """The unsigned answer to a frame that failed authentication (``code`` UNAUTHENTICATED) or
    was not a frame (MALFORMED). Nothing of the refused frame is echoed."""
    text = (
        "frame refused: it did not authenticate with this server's secret"
        if code == UNAUTHENTICATED
        else "frame refused: not a valid trainmesh parameter-server frame"
    )
    return bytes(encode(Message(MessageType.ERROR, server_id, 0, meta={"error": text, "code": code})))


def rejection_code(frame) -> str | None:
    """UNAUTHENTICATED or MALFORMED if ``frame`` is a server's rejection (see ``rejection_frame``),
    else None. Only the code is read: the client words its own error."""
    try:
        msg = decode(frame, None, _REJECTION_MAX_BYTES)
    except (ProtocolError, TypeError):
        return None
    return _code_of(msg)


def _code_of(msg: Message) -> str | None:
    code = msg.meta.get("code")
    if msg.type is MessageType.ERROR and msg.seq == 0 and not msg.tensors and code in (UNAUTHENTICATED, MALFORMED):
        return code
    return None


def rejection_in(msg: Message) -> str | None:
    """The rejection code of an already decoded reply (a client without a secret reads them so)."""
    return _code_of(msg)


def refusal_text(code: str, server: str) -> str:
    """What a client tells its caller when ``server`` rejected its frames."""
    if code == UNAUTHENTICATED:
        return (
            f"authentication failed: parameter server {server} rejected this client's frames (their HMAC "
            f"is missing or made with another secret). Give every process of the job the servers' secret: "
            f"secret=, {SECRET_ENV} or {SECRET_FILE_ENV}"
        )
    return (
        f"parameter server {server} rejected this client's frames as malformed (not authenticated "
        f"trainmesh frames: another protocol version, or another program?)"
    )


# -- the server's side: counting, answering and logging strangers ----------------------------


@dataclass
class _Peer:
    logged_at: float = -float("inf")
    replied_at: float = -float("inf")
    unlogged: int = 0  # rejections not yet in a log line
    reason: str = ""


class RejectGuard:
    """Decides, per rejected frame, whether to answer it now, and logs rejections sparingly."""

    def __init__(
        self,
        server_id: str,
        logger: logging.Logger,
        *,
        log_interval_s: float = 60.0,
        reply_interval_s: float = 0.25,
        max_log_lines: int = 4,
        max_peers: int = 4096,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.server_id, self.log = server_id, logger
        self.log_interval_s, self.reply_interval_s = log_interval_s, reply_interval_s
        self.max_log_lines, self.max_peers, self.clock = max_log_lines, max_peers, clock
        self._peers: dict[bytes, _Peer] = {}
        self._window_start, self._lines = -float("inf"), 0
        self._dropped = 0  # rejections of peers forgotten (table full) before they were logged

    def reject(self, peer, error: BaseException) -> bool:
        """Record one rejected frame from ``peer``; True when it should be answered now."""
        now = self.clock()
        key = bytes(peer) if isinstance(peer, (bytes, bytearray, memoryview)) else repr(peer).encode()
        entry = self._peers.get(key)
        if entry is None:
            if len(self._peers) >= self.max_peers:
                self._forget()
            entry = self._peers[key] = _Peer()
        entry.unlogged += 1
        entry.reason = str(error)[:200]
        if now - entry.logged_at >= self.log_interval_s:
            self._maybe_log(key, entry, now)
        if now - entry.replied_at >= self.reply_interval_s:
            entry.replied_at = now
            return True
        return False

    def _maybe_log(self, key: bytes, entry: _Peer, now: float) -> None:
        if now - self._window_start >= self.log_interval_s:
            self._window_start, self._lines = now, 0
        if self._lines >= self.max_log_lines:
            return  # counted in entry.unlogged: reported in a later interval or by flush()
        self._lines += 1
        dropped, self._dropped = self._dropped, 0
        self.log.warning(
            "ps %s: rejected %d unauthenticated frame(s) from peer %r (last: %s); further rejections "
            "from it are logged at most every %.0fs%s",
            self.server_id,
            entry.unlogged,
            key[:40],
            entry.reason,
            self.log_interval_s,
            f"; {dropped} more from peers not tracked" if dropped else "",
        )
        entry.logged_at, entry.unlogged = now, 0

    def _forget(self) -> None:
        """Make room: the counts of the peers forgotten go to a total reported with the next line."""
        for entry in self._peers.values():
            self._dropped += entry.unlogged
        self._peers.clear()

    def flush(self) -> None:
        """One line for every rejection not logged yet (when the server stops)."""
        unlogged = self._dropped + sum(e.unlogged for e in self._peers.values())
        if unlogged:
            peers = sum(1 for e in self._peers.values() if e.unlogged)
            self.log.warning(
                "ps %s: %d more unauthenticated frame(s) were rejected without a log line of their own (%d peer(s))",
                self.server_id,
                unlogged,
                peers,
            )
        self._dropped = 0
        for entry in self._peers.values():
            entry.unlogged = 0
