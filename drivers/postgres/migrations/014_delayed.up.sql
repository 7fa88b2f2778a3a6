-- Delayed side effects: recorded in a unit of work to be sent at a later time. They wait here,
-- apart from the pending effects, so that they hold back no ordering key, count in no backlog,
-- and cost a relay pass two index probes (what is due, and when the next is) however many wait.
-- The relay moves each, when due, into the effects table, behind what is pending with its
-- ordering key then; a unit of work cancels one by its cancel key until it is moved.
CREATE TABLE IF NOT EXISTS "{{schema}}"."{{prefix}}delayed" (
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
    due_at          timestamptz NOT NULL,
    cancel_key      text
);

CREATE INDEX IF NOT EXISTS "{{prefix}}delayed_due"
    ON "{{schema}}"."{{prefix}}delayed" (due_at, id);
CREATE INDEX IF NOT EXISTS "{{prefix}}delayed_cancel"
    ON "{{schema}}"."{{prefix}}delayed" (cancel_key) WHERE cancel_key IS NOT NULL;
