-- Processed-message claims: one row per (consumer, message ID). dispatched_at is when the last
-- side effect was dispatched (processing time when there were none); retention counts from it,
-- and a claim with an undispatched effect is never deleted.
CREATE TABLE IF NOT EXISTS "{{schema}}"."{{prefix}}processed" (
    consumer      text        NOT NULL,
    message_id    text        NOT NULL,
    processed_at  timestamptz NOT NULL DEFAULT now(),
    dispatched_at timestamptz,
    poisoned      boolean     NOT NULL DEFAULT false,
    PRIMARY KEY (consumer, message_id)
) WITH (fillfactor = 90);

-- processed_at only grows, so a BRIN index finds expired claims at almost no write cost.
CREATE INDEX IF NOT EXISTS "{{prefix}}processed_processed_at"
    ON "{{schema}}"."{{prefix}}processed" USING brin (processed_at);

-- Side effects: messages to publish and custom effects, stored in the business transaction.
CREATE TABLE IF NOT EXISTS "{{schema}}"."{{prefix}}effects" (
    id              bigserial   PRIMARY KEY,
    source_consumer text        NOT NULL,
    source_id       text        NOT NULL,
    seq             integer     NOT NULL,
    kind            text        NOT NULL,
    topic           text        NOT NULL,
    uuid            text        NOT NULL,
    payload         bytea       NOT NULL,
    metadata        bytea       NOT NULL,
    ordering_key    text        NOT NULL,
    created_at      timestamptz NOT NULL DEFAULT now(),
    dispatched_at   timestamptz,
    attempts        integer     NOT NULL DEFAULT 0,
    last_error      text,
    next_attempt_at timestamptz,
    parked_at       timestamptz
);

-- The pending indexes hold only undispatched rows, so they stay small whatever the retention.
CREATE INDEX IF NOT EXISTS "{{prefix}}effects_pending_source"
    ON "{{schema}}"."{{prefix}}effects" (source_consumer, source_id, seq) WHERE dispatched_at IS NULL;
CREATE INDEX IF NOT EXISTS "{{prefix}}effects_pending_key"
    ON "{{schema}}"."{{prefix}}effects" (ordering_key, id) WHERE dispatched_at IS NULL;
CREATE INDEX IF NOT EXISTS "{{prefix}}effects_pending"
    ON "{{schema}}"."{{prefix}}effects" (id) WHERE dispatched_at IS NULL;

-- Failed attempts, counted outside the rolled-back business transaction.
CREATE TABLE IF NOT EXISTS "{{schema}}"."{{prefix}}attempts" (
    consumer        text        NOT NULL,
    message_id      text        NOT NULL,
    attempts        integer     NOT NULL,
    last_error      text        NOT NULL,
    first_failed_at timestamptz NOT NULL DEFAULT now(),
    last_failed_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer, message_id)
);
