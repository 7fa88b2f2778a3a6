-- Dead letters: messages a consumer gave up on (failed MaxAttempts times, failed with a permanent
-- error, or could not be identified), kept with what is needed to hand them back to it. The
-- message's claim is written as poisoned in the same transaction, so redelivered copies are
-- acked. state is 'dead' until an operator (or the redrive policy) retries or discards it;
-- changed_at and changed_by say when and who. retries counts the retries, which the redrive
-- policy bounds.
CREATE TABLE IF NOT EXISTS "{{schema}}"."{{prefix}}dead_letters" (
    consumer     text        NOT NULL,
    message_id   text        NOT NULL,
    source_topic text        NOT NULL,
    payload      bytea       NOT NULL,
    metadata     bytea       NOT NULL,
    reason       text        NOT NULL,
    attempts     integer     NOT NULL,
    permanent    boolean     NOT NULL DEFAULT false,
    dead_at      timestamptz NOT NULL DEFAULT now(),
    state        text        NOT NULL DEFAULT 'dead',
    changed_at   timestamptz,
    changed_by   text        NOT NULL DEFAULT '',
    retries      integer     NOT NULL DEFAULT 0,
    PRIMARY KEY (consumer, message_id)
);

-- The operators' list and the counts look at the dead ones only, oldest first.
CREATE INDEX IF NOT EXISTS "{{prefix}}dead_letters_dead"
    ON "{{schema}}"."{{prefix}}dead_letters" (dead_at) WHERE state = 'dead';
