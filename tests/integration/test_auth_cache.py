"""The key → tenant cache: one query less per request, and a revoked key stops working once its entry expires."""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy import update

from api import auth
from api.orm import ApiKey


def test_revoked_key_works_until_the_cache_entry_expires_then_fails(db: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    now = [1000.0]
    monkeypatch.setattr(auth.time, "monotonic", lambda: now[0])
    with db() as s:
        tenant, key = auth.create_key(s, tenant_name="cache-test")
    with db() as s:
        assert auth.tenant_for_key(s, key).id == tenant.id
        s.execute(update(ApiKey).where(ApiKey.tenant_id == tenant.id).values(revoked_at=1))
    now[0] += auth.KEY_CACHE_SECONDS - 1
    with db() as s:
        assert auth.tenant_for_key(s, key).id == tenant.id  # still cached
    now[0] += 2
    with db() as s:
        assert auth.tenant_for_key(s, key) is None  # expired: the database says revoked
    with db() as s:
        assert auth.tenant_for_key(s, "sk-prx-not-a-key") is None
