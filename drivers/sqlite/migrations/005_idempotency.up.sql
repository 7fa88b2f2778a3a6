-- The idempotency keys of keyed units of work at the boundary (see the PostgreSQL migration).
CREATE TABLE IF NOT EXISTS "{{schema}}"."{{prefix}}idempotency" (
    scope       TEXT      NOT NULL,
    key         TEXT      NOT NULL,
    fingerprint BLOB      NOT NULL,
    result      BLOB      NOT NULL DEFAULT x'',
    created_at  TIMESTAMP NOT NULL DEFAULT (strftime('%Y-%m-%d %H:%M:%f', 'now')),
    expires_at  TIMESTAMP NOT NULL,
    PRIMARY KEY (scope, key)
) WITHOUT ROWID;

CREATE INDEX IF NOT EXISTS "{{schema}}"."{{prefix}}idempotency_expiry"
    ON "{{prefix}}idempotency" (expires_at);
