"""key revocations notify the API processes

A statement trigger on ``api_keys`` sends a notification on ``proxima_api_keys`` (``api.auth.REVOCATION_CHANNEL``)
after any UPDATE, DELETE or TRUNCATE of the table: a revocation, by ``proxima keys revoke`` or by SQL, and a tenant's
deletion (its keys are deleted by the cascade, which fires the trigger too). Every API process listens and stops
trusting its key cache at once (``api.auth``). PostgreSQL only: SQLite has no notifications, and the API caches no
key there.

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-01 20:30:00
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

CHANNEL = "proxima_api_keys"  # api.auth.REVOCATION_CHANNEL (a migration keeps its own copy: it must not change)


def upgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    op.execute(
        f"""
        CREATE FUNCTION proxima_api_keys_changed() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            PERFORM pg_notify('{CHANNEL}', '');
            RETURN NULL;
        END
        $$
        """
    )
    op.execute(
        """
        CREATE TRIGGER api_keys_changed AFTER UPDATE OR DELETE OR TRUNCATE ON api_keys
        FOR EACH STATEMENT EXECUTE FUNCTION proxima_api_keys_changed()
        """
    )


def downgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    op.execute("DROP TRIGGER IF EXISTS api_keys_changed ON api_keys")
    op.execute("DROP FUNCTION IF EXISTS proxima_api_keys_changed()")
