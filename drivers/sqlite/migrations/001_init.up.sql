-- SQLite has no schemas: {{schema}} is always "main", and tables are told apart by {{prefix}}.
-- Timestamps are TEXT in UTC, 'YYYY-MM-DD HH:MM:SS.SSS' (strftime('%Y-%m-%d %H:%M:%f', 'now')):
-- they compare correctly as strings, keep milliseconds, and their declared type TIMESTAMP lets
-- the database/sql drivers (modernc.org/sqlite, mattn/go-sqlite3) return them as time.Time.

-- Processed-message claims: one row per (consumer, message ID). dispatched_at is when the last
-- side effect was dispatched (processing time when there were none); retention counts from it,
-- and a claim with an undispatched effect is never deleted.
CREATE TABLE IF NOT EXISTS "{{schema}}"."{{prefix}}processed" (
    consumer      TEXT      NOT NULL,
    message_id    TEXT      NOT NULL,
    processed_at  TIMESTAMP NOT NULL DEFAULT (strftime('%Y-%m-%d %H:%M:%f', 'now')),
    dispatched_at TIMESTAMP,
    poisoned      INTEGER   NOT NULL DEFAULT 0,
    PRIMARY KEY (consumer, message_id)
) WITHOUT ROWID;

CREATE INDEX IF NOT EXISTS "{{schema}}"."{{prefix}}processed_processed_at"
    ON "{{prefix}}processed" (processed_at);

-- Side effects: messages to publish and custom effects, stored in the business transaction.
-- AUTOINCREMENT: an id is never reused, so it stays a stable handle for operators and ids
-- follow commit order (SQLite has a single writer).
CREATE TABLE IF NOT EXISTS "{{schema}}"."{{prefix}}effects" (
    id              INTEGER   PRIMARY KEY AUTOINCREMENT,
    source_consumer TEXT      NOT NULL,
    source_id       TEXT      NOT NULL,
    seq             INTEGER   NOT NULL,
    kind            TEXT      NOT NULL,
    topic           TEXT      NOT NULL,
    uuid            TEXT      NOT NULL,
    payload         BLOB      NOT NULL,
    metadata        BLOB      NOT NULL,
    ordering_key    TEXT      NOT NULL,
    created_at      TIMESTAMP NOT NULL DEFAULT (strftime('%Y-%m-%d %H:%M:%f', 'now')),
    dispatched_at   TIMESTAMP,
    attempts        INTEGER   NOT NULL DEFAULT 0,
    last_error      TEXT,
    next_attempt_at TIMESTAMP,
    parked_at       TIMESTAMP
);

-- The pending indexes hold only undispatched rows, so they stay small whatever the retention.
CREATE INDEX IF NOT EXISTS "{{schema}}"."{{prefix}}effects_pending_source"
    ON "{{prefix}}effects" (source_consumer, source_id, seq) WHERE dispatched_at IS NULL;
CREATE INDEX IF NOT EXISTS "{{schema}}"."{{prefix}}effects_pending_key"
    ON "{{prefix}}effects" (ordering_key, id) WHERE dispatched_at IS NULL;
CREATE INDEX IF NOT EXISTS "{{schema}}"."{{prefix}}effects_pending"
    ON "{{prefix}}effects" (id) WHERE dispatched_at IS NULL;

-- A statement updates one table in SQLite, so the claim's dispatch time follows its effects here:
-- whatever marks an effect dispatched (the fast path, the relay, a discard) moves the claim's
-- retention clock in the same statement.
CREATE TRIGGER IF NOT EXISTS "{{schema}}"."{{prefix}}effects_dispatched"
    AFTER UPDATE OF dispatched_at ON "{{prefix}}effects"
    FOR EACH ROW WHEN OLD.dispatched_at IS NULL AND NEW.dispatched_at IS NOT NULL
BEGIN
    UPDATE "{{prefix}}processed" SET dispatched_at = NEW.dispatched_at
    WHERE consumer = NEW.source_consumer AND message_id = NEW.source_id;
END;

-- Failed attempts, counted outside the rolled-back business transaction.
CREATE TABLE IF NOT EXISTS "{{schema}}"."{{prefix}}attempts" (
    consumer        TEXT      NOT NULL,
    message_id      TEXT      NOT NULL,
    attempts        INTEGER   NOT NULL,
    last_error      TEXT      NOT NULL,
    first_failed_at TIMESTAMP NOT NULL DEFAULT (strftime('%Y-%m-%d %H:%M:%f', 'now')),
    last_failed_at  TIMESTAMP NOT NULL DEFAULT (strftime('%Y-%m-%d %H:%M:%f', 'now')),
    PRIMARY KEY (consumer, message_id)
) WITHOUT ROWID;
