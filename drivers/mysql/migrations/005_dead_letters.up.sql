-- Dead letters (see the PostgreSQL migration of the same name). The identifier columns are
-- binary strings, as migration 004 made those of the other tables: they compare byte for byte.
-- MySQL has no partial index: the list's index leads with the state.
CREATE TABLE IF NOT EXISTS `{{schema}}`.`{{prefix}}dead_letters` (
    consumer     VARBINARY(1020) NOT NULL,
    message_id   VARBINARY(1020) NOT NULL,
    source_topic BLOB            NOT NULL,
    payload      LONGBLOB        NOT NULL,
    metadata     LONGBLOB        NOT NULL,
    reason       TEXT            NOT NULL,
    attempts     INT             NOT NULL,
    permanent    BOOLEAN         NOT NULL DEFAULT FALSE,
    dead_at      DATETIME(6)     NOT NULL,
    state        VARCHAR(16)     NOT NULL DEFAULT 'dead',
    changed_at   DATETIME(6)     NULL,
    changed_by   TEXT            NOT NULL,
    retries      INT             NOT NULL DEFAULT 0,
    PRIMARY KEY (consumer, message_id),
    KEY dead_letters_state (state, dead_at)
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_bin;
