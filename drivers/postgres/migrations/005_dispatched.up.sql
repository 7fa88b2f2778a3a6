-- Dispatched effects kept for EffectRetention live in a table of their own, so that the effects
-- table holds only what is pending: it stays small whatever the retention, autovacuum keeps it
-- clean (a large table is vacuumed rarely, and the dead index entries that the marks leave behind
-- slowed the relay's claims down more with every drain), and the relay's statements never meet
-- the dispatched rows. The marks move the rows here; cleanup deletes them after EffectRetention.
CREATE TABLE IF NOT EXISTS "{{schema}}"."{{prefix}}dispatched" (
    id              bigint      PRIMARY KEY,
    source_consumer text        NOT NULL,
    source_id       text        NOT NULL,
    seq             integer     NOT NULL,
    kind            text        NOT NULL,
    topic           text        NOT NULL,
    uuid            text        NOT NULL,
    payload         bytea       NOT NULL,
    metadata        bytea       NOT NULL,
    ordering_key    text        NOT NULL,
    created_at      timestamptz NOT NULL,
    dispatched_at   timestamptz NOT NULL,
    attempts        integer     NOT NULL,
    failures        integer     NOT NULL,
    last_error      text
);

-- dispatched_at only grows: a BRIN index finds the expired rows at almost no write cost.
CREATE INDEX IF NOT EXISTS "{{prefix}}dispatched_dispatched_at"
    ON "{{schema}}"."{{prefix}}dispatched" USING brin (dispatched_at);
CREATE INDEX IF NOT EXISTS "{{prefix}}dispatched_source"
    ON "{{schema}}"."{{prefix}}dispatched" (source_consumer, source_id);

-- Rows dispatched before this version move over.
WITH moved AS (
    DELETE FROM "{{schema}}"."{{prefix}}effects" WHERE dispatched_at IS NOT NULL
    RETURNING id, source_consumer, source_id, seq, kind, topic, uuid, payload, metadata, ordering_key,
              created_at, dispatched_at, attempts, failures, last_error)
INSERT INTO "{{schema}}"."{{prefix}}dispatched"
SELECT * FROM moved ON CONFLICT (id) DO NOTHING;
