-- The idempotency keys of keyed units of work at the boundary (Outbox.InTx with
-- outbox.WithIdempotencyKey): a key is claimed in the transaction of the business change and its
-- effects, with the fingerprint of the request and the unit's result, so that a retry of the
-- request finds it committed (or waits behind the uncommitted claim) and runs nothing. The expiry
-- is written with each key at its claim: a cleanup deletes only what has expired, whoever runs it
-- and with whatever retention.
CREATE TABLE IF NOT EXISTS "{{schema}}"."{{prefix}}idempotency" (
    scope       text        NOT NULL,
    key         text        NOT NULL,
    fingerprint bytea       NOT NULL,
    result      bytea       NOT NULL DEFAULT '',
    created_at  timestamptz NOT NULL DEFAULT now(),
    expires_at  timestamptz NOT NULL,
    PRIMARY KEY (scope, key)
);
CREATE INDEX IF NOT EXISTS "{{prefix}}idempotency_expiry"
    ON "{{schema}}"."{{prefix}}idempotency" (expires_at);
