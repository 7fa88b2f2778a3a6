-- What operators changed (retry, discard, replay), by whom and when: written by the CLI
-- (cmd/outbox) and by ops.Ops, shown by `outbox status`.
CREATE TABLE IF NOT EXISTS "{{schema}}"."{{prefix}}audit" (
    id     bigserial   PRIMARY KEY,
    at     timestamptz NOT NULL DEFAULT now(),
    actor  text        NOT NULL,
    action text        NOT NULL,
    target text        NOT NULL,
    detail text        NOT NULL DEFAULT ''
);
