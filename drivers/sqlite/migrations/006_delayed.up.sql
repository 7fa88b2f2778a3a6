-- Delayed side effects, kept apart from the pending ones until they are due (see the PostgreSQL
-- migration of the same name). The relay moves the due ones into the effects table.
CREATE TABLE IF NOT EXISTS "{{schema}}"."{{prefix}}delayed" (
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
    due_at          TIMESTAMP NOT NULL,
    cancel_key      TEXT
);

CREATE INDEX IF NOT EXISTS "{{schema}}"."{{prefix}}delayed_due"
    ON "{{prefix}}delayed" (due_at, id);
CREATE INDEX IF NOT EXISTS "{{schema}}"."{{prefix}}delayed_cancel"
    ON "{{prefix}}delayed" (cancel_key) WHERE cancel_key IS NOT NULL;
