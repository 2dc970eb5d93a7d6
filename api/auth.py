"""API keys: stored as sha256 hashes; ``Authorization: Bearer <key>`` resolves to a tenant.

Each API process remembers a key's tenant for ``KEY_CACHE_SECONDS`` (one query less on every request, the hot path
of a job poll), yet a revoked key, or a deleted tenant's, fails at once on every process:

- On PostgreSQL a trigger on ``api_keys`` (migration ``2026_12_01_0002``) sends a notification on
  ``REVOCATION_CHANNEL`` whenever keys are revoked or deleted, by any means: ``proxima keys revoke``, SQL, or a
  tenant's deletion (its keys go with it by the foreign key's cascade).
- Each API process listens on a connection of its own (``Revocations``). A cached entry is used only if no
  notification arrived on it since the entry was looked up: a non-blocking read of that connection's socket on
  every cache hit (about 2 µs). PostgreSQL signals the listening sessions as the revocation commits, and each
  sends the notification on its socket as soon as it runs: measured 0.09 ms after the commit at the median and
  20 ms at the 99th percentile on a 2-core machine at load 8, less than ``proxima keys revoke`` takes to exit. A
  request that races the notification is served as one that arrived just before the commit.
- While that connection is down (it is re-opened on the next lookup, at most every ``LISTEN_RETRY_SECONDS``),
  and on SQLite (no notifications; the embedded default, one machine), nothing is cached: every request looks its
  key up.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Any

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from api import ids
from api.db import SOCKET_TIMEOUT_MS, engine_for
from api.orm import ApiKey, Tenant, now

log = logging.getLogger("proxima.api.auth")

REVOCATION_CHANNEL = "proxima_api_keys"
"""The PostgreSQL notification channel of key revocations (the trigger of migration ``2026_12_01_0002``)."""


PREFIX_CHARS = 10
"""The start of a key kept in clear (``api_keys.prefix``), to recognise it in ``proxima keys list``."""


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def create_key(session: Session, *, tenant_name: str) -> tuple[Tenant, str]:
    """A new key for the tenant (created when missing); the key itself is only ever returned here."""
    tenant = session.scalar(select(Tenant).where(Tenant.name == tenant_name))
    if tenant is None:
        tenant = Tenant(id=ids.tenant_id(), name=tenant_name)
        session.add(tenant)
        session.flush()
    key = ids.api_key()
    session.add(ApiKey(tenant_id=tenant.id, key_hash=hash_key(key), prefix=key[:PREFIX_CHARS]))
    return tenant, key


# -- administration: listing and revoking (``proxima keys``) ------------------------------------------------------


def tenants_with_keys(session: Session) -> list[tuple[Tenant, list[ApiKey]]]:
    """Every tenant with its keys (oldest first), tenants by name; keys hold their hash and prefix, never the key."""
    tenants = session.scalars(select(Tenant).order_by(Tenant.name)).all()
    keys: dict[str, list[ApiKey]] = {t.id: [] for t in tenants}
    for k in session.scalars(select(ApiKey).order_by(ApiKey.created_at, ApiKey.id)):
        keys[k.tenant_id].append(k)
    return [(t, keys[t.id]) for t in tenants]


def find_keys(session: Session, ref: str) -> list[ApiKey]:
    """The keys ``ref`` names: a key's id (as ``proxima keys list`` shows it), the whole key, or the start of its
    prefix (all keys whose prefix starts so: more than one when it is ambiguous)."""
    ref = ref.strip()
    if not ref:
        return []
    if ref.isdigit():
        key = session.get(ApiKey, int(ref)) if int(ref) < 2**31 else None  # api_keys.id is an int4
        return [key] if key is not None else []
    exact = session.scalar(select(ApiKey).where(ApiKey.key_hash == hash_key(ref)))
    if exact is not None:
        return [exact]
    if len(ref) > PREFIX_CHARS:
        return []  # longer than any prefix and not a key
    return list(session.scalars(select(ApiKey).where(ApiKey.prefix.startswith(ref, autoescape=True))))


def revoke(session: Session, *, key_id: int) -> bool:
    """Revoke a key (True), or find it already revoked (False). The trigger tells every API process."""
    result = session.execute(
        update(ApiKey).where(ApiKey.id == key_id, ApiKey.revoked_at.is_(None)).values(revoked_at=now())
    )
    return bool(result.rowcount)  # type: ignore[attr-defined]


# -- resolving a request's key -------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Caller:
    """The tenant a request acts for, as routes and services see it: its fields, not a session-bound row (one
    object per key, shared by the requests of the key cache's lifetime)."""

    id: str
    name: str
    created_at: int


def tenant_for_key(session: Session, key: str) -> Caller | None:
    """The key's tenant from the database (no cache); None for an unknown or revoked key."""
    tenant = session.scalar(
        select(Tenant)
        .join(ApiKey, ApiKey.tenant_id == Tenant.id)
        .where(ApiKey.key_hash == hash_key(key), ApiKey.revoked_at.is_(None))
    )
    if tenant is None:
        return None
    return Caller(id=tenant.id, name=tenant.name, created_at=tenant.created_at)


def tenant_exists(session: Session, *, tenant_id: str) -> bool:
    return session.get(Tenant, tenant_id) is not None


KEY_CACHE_SECONDS = 10.0
"""How long a process trusts a key it looked up when no revocation arrives: a bound on the cache, not on how long a
revoked key keeps working (that is not at all, see the module's docstring)."""
KEY_CACHE_ENTRIES = 10_000
LISTEN_RETRY_SECONDS = 1.0
"""While the listening connection cannot be opened, a lookup tries again at most this often."""
# TCP keep-alives on the listening connection: a peer that went away silently (a partition, a frozen host) shows as
# a dead connection within about 10 s, and the cache is bypassed from then on; a cached entry lives at most
# KEY_CACHE_SECONDS anyway.
_LISTEN_CONNECT_ARGS = {
    "connect_timeout": 5,
    "tcp_user_timeout": SOCKET_TIMEOUT_MS,  # built from the URL alone, so api.db's defaults are not applied
    "keepalives": 1,
    "keepalives_idle": 5,
    "keepalives_interval": 2,
    "keepalives_count": 3,
}


class Revocations:
    """One process's view of ``REVOCATION_CHANNEL`` for one PostgreSQL database, as an epoch: a number that changes
    whenever a notification arrives, the listening connection is lost, or it is opened again. A cache entry records
    the epoch read before its lookup and is valid while the epoch is unchanged.

    ``epoch()`` runs on the event loop: it never blocks (a non-blocking read of the socket; when a lookup thread is
    opening the connection, it answers None rather than wait). ``ensure()`` runs in the lookup's thread and may
    connect."""

    def __init__(self, url: str) -> None:
        self.url = url
        self._lock = threading.Lock()
        self._conn: Any = None  # a psycopg2 connection in autocommit mode, LISTENing
        self._pid = os.getpid()
        self._epoch = 0
        self._next_attempt = 0.0

    def epoch(self) -> int | None:
        """The current epoch, after reading any notification that arrived; None when nothing may be cached (no
        listening connection, or it is being opened right now)."""
        if not self._lock.acquire(blocking=False):
            return None
        try:
            return self._drain()
        finally:
            self._lock.release()

    def ensure(self) -> int | None:
        """``epoch()``, first opening the listening connection if it is down (at most every
        ``LISTEN_RETRY_SECONDS``); None while it cannot be opened. It never waits for another thread's attempt (a
        database that does not answer would hold every lookup for the connect timeout): that lookup caches
        nothing."""
        if not self._lock.acquire(blocking=False):
            return None
        try:
            current = self._drain()
            if current is not None or time.monotonic() < self._next_attempt:
                return current
            self._next_attempt = time.monotonic() + LISTEN_RETRY_SECONDS
            try:
                self._conn = _listen(self.url)
            except Exception as err:  # the database is down: lookups fail on their own; nothing is cached
                log.warning("cannot listen for key revocations (nothing is cached meanwhile): %s", err)
                return None
            self._pid = os.getpid()
            self._epoch += 1
            return self._epoch
        finally:
            self._lock.release()

    def close(self) -> None:
        with self._lock:
            self._lost()

    def _drain(self) -> int | None:
        conn = self._conn
        if conn is None:
            return None
        if self._pid != os.getpid():  # a forked child: the connection is its parent's; open its own
            self._conn = None
            return None
        try:
            conn.poll()  # reads what has arrived, without waiting
        except Exception as err:  # psycopg2.Error: the connection is gone
            log.warning("lost the connection that listens for key revocations: %s", err)
            self._lost()
            return None
        if conn.notices:
            # A listening connection gets no notices, except the FATAL a server sends before it closes the
            # connection (terminated backend, shutdown): from then on it would hear nothing.
            log.warning("the connection that listens for key revocations is closing: %s", conn.notices[-1].strip())
            self._lost()
            return None
        if conn.notifies:
            conn.notifies.clear()
            self._epoch += 1
        return self._epoch

    def _lost(self) -> None:
        if self._conn is not None:
            with contextlib.suppress(Exception):  # already closed: nothing to release
                self._conn.close()
        self._conn = None
        self._epoch += 1


def _listen(url: str) -> Any:
    """A new psycopg2 connection to ``url``'s database, LISTENing on ``REVOCATION_CHANNEL``."""
    engine = engine_for(url)
    cargs, cparams = engine.dialect.create_connect_args(engine.url)
    conn = engine.dialect.loaded_dbapi.connect(*cargs, **{**cparams, **_LISTEN_CONNECT_ARGS})
    try:
        conn.autocommit = True
        with conn.cursor() as cur:
            cur.execute(f"LISTEN {REVOCATION_CHANNEL}")
    except BaseException:
        conn.close()
        raise
    return conn


def can_listen(url: str) -> bool:
    """Whether ``url``'s database can notify revocations: PostgreSQL through psycopg2 (another driver: no cache)."""
    if url.startswith("sqlite"):
        return False
    try:
        dialect = engine_for(url).dialect
    except Exception:  # its driver is not installed: the requests' own lookups will say so
        return False
    return dialect.name == "postgresql" and dialect.driver == "psycopg2"


_revocations: dict[str, Revocations | None] = {}
_revocations_lock = threading.Lock()


def revocations(url: str) -> Revocations | None:
    """This process's listener for ``url``; None where revocations cannot be heard (SQLite)."""
    try:
        return _revocations[url]
    except KeyError:
        pass
    with _revocations_lock:
        if url not in _revocations:
            _revocations[url] = Revocations(url) if can_listen(url) else None
        return _revocations[url]


@dataclass(frozen=True, slots=True)
class _Entry:
    expires: float
    epoch: int
    caller: Caller


_key_cache: dict[tuple[str, str], _Entry] = {}


def cached_tenant(url: str, key: str) -> Caller | None:
    """The key's tenant if this process looked it up recently and no revocation has arrived since, else None. No
    blocking I/O: it may run on the event loop."""
    entry = _key_cache.get((url, hash_key(key)))
    if entry is None or entry.expires <= time.monotonic():
        return None
    listener = revocations(url)
    if listener is None or listener.epoch() != entry.epoch:
        return None
    return entry.caller


def lookup_tenant(session: Session, url: str, key: str) -> Caller | None:
    """The key's tenant from the database, remembered for ``cached_tenant`` when revocations can be heard. Blocking:
    run it in a thread."""
    listener = revocations(url)
    epoch = listener.ensure() if listener is not None else None  # read before the lookup: see Revocations
    caller = tenant_for_key(session, key)
    if caller is not None and epoch is not None:
        if len(_key_cache) >= KEY_CACHE_ENTRIES:
            _key_cache.clear()
        _key_cache[(url, hash_key(key))] = _Entry(time.monotonic() + KEY_CACHE_SECONDS, epoch, caller)
    return caller


def watch_revocations(url: str) -> None:
    """Open this process's listening connection now (an API process's start-up), not on its first request."""
    listener = revocations(url)
    if listener is not None:
        listener.ensure()


def forget(url: str) -> None:
    """Drop this process's cache and listener for ``url`` (before the database is dropped, in tests)."""
    for k in [k for k in _key_cache if k[0] == url]:
        _key_cache.pop(k, None)
    with _revocations_lock:
        listener = _revocations.pop(url, None)
    if listener is not None:
        listener.close()
