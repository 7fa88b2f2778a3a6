-- Dead letters (see the PostgreSQL migration of the same name).
CREATE TABLE IF NOT EXISTS "{{schema}}"."{{prefix}}dead_letters" (
    consumer     TEXT      NOT NULL,
    message_id   TEXT      NOT NULL,
    source_topic TEXT      NOT NULL,
    payload      BLOB      NOT NULL,
    metadata     BLOB      NOT NULL,
    reason       TEXT      NOT NULL,
    attempts     INTEGER   NOT NULL,
    permanent    INTEGER   NOT NULL DEFAULT 0,
    dead_at      TIMESTAMP NOT NULL DEFAULT (strftime('%Y-%m-%d %H:%M:%f', 'now')),
    state        TEXT      NOT NULL DEFAULT 'dead',
    changed_at   TIMESTAMP,
    changed_by   TEXT      NOT NULL DEFAULT '',
    retries      INTEGER   NOT NULL DEFAULT 0,
    PRIMARY KEY (consumer, message_id)
);
