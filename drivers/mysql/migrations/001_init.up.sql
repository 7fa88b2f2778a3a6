-- The outbox tables on MySQL 8.0+ and MariaDB 10.6+. DDL commits implicitly there, so a
-- migration cannot roll back: every statement is idempotent (CREATE TABLE IF NOT EXISTS with its
-- indexes inline, INSERT IGNORE), and the migrator, which holds GET_LOCK, runs them again after
-- a crash half way. {{schema}} is the database (`` when the connection's own, see Driver.Open).
-- Text is utf8mb4 with binary collation, which is PAD SPACE ('a' = 'a '): migration 004 makes the
-- identifier columns binary strings, so that they compare byte for byte as on PostgreSQL.
-- Timestamps are DATETIME(6) in UTC (UTC_TIMESTAMP(6)), whatever the session's time zone.

-- Processed-message claims: one row per (consumer, message ID). dispatched_at is when the last
-- side effect was dispatched (processing time when there were none); retention counts from it,
-- and a claim with an undispatched effect is never deleted.
CREATE TABLE IF NOT EXISTS `{{schema}}`.`{{prefix}}processed` (
    consumer      VARCHAR(255) NOT NULL,
    message_id    VARCHAR(255) NOT NULL,
    processed_at  DATETIME(6)  NOT NULL,
    dispatched_at DATETIME(6)  NOT NULL,
    poisoned      BOOLEAN      NOT NULL DEFAULT FALSE,
    PRIMARY KEY (consumer, message_id),
    KEY processed_dispatched_at (dispatched_at)
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_bin;

-- Side effects: messages to publish and custom effects, stored in the business transaction, and
-- kept with dispatched_at set for EffectRetention once sent. MySQL has no partial indexes: the
-- pending ones lead with dispatched_at, so that the pending rows (dispatched_at IS NULL) are one
-- range of them whatever the retention.
CREATE TABLE IF NOT EXISTS `{{schema}}`.`{{prefix}}effects` (
    id              BIGINT       NOT NULL AUTO_INCREMENT,
    source_consumer VARCHAR(255) NOT NULL,
    source_id       VARCHAR(255) NOT NULL,
    seq             INT          NOT NULL,
    kind            TEXT         NOT NULL,
    topic           TEXT         NOT NULL,
    uuid            TEXT         NOT NULL,
    payload         LONGBLOB     NOT NULL,
    metadata        LONGBLOB     NOT NULL,
    ordering_key    VARCHAR(255) NOT NULL,
    created_at      DATETIME(6)  NOT NULL,
    dispatched_at   DATETIME(6)  NULL,
    attempts        INT          NOT NULL DEFAULT 0,
    failures        INT          NOT NULL DEFAULT 0,
    last_error      TEXT         NULL,
    failed_at       DATETIME(6)  NULL,
    next_attempt_at DATETIME(6)  NULL,
    parked_at       DATETIME(6)  NULL,
    PRIMARY KEY (id),
    KEY effects_source (source_consumer, source_id, dispatched_at, seq),
    KEY effects_key (ordering_key, dispatched_at, id),
    KEY effects_pending (dispatched_at, parked_at, id),
    KEY effects_parked (parked_at, dispatched_at, id)
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_bin;

-- Failed attempts, counted outside the rolled-back business transaction.
CREATE TABLE IF NOT EXISTS `{{schema}}`.`{{prefix}}attempts` (
    consumer        VARCHAR(255) NOT NULL,
    message_id      VARCHAR(255) NOT NULL,
    attempts        INT          NOT NULL,
    last_error      TEXT         NOT NULL,
    first_failed_at DATETIME(6)  NOT NULL,
    last_failed_at  DATETIME(6)  NOT NULL,
    PRIMARY KEY (consumer, message_id),
    KEY attempts_last_failed_at (last_failed_at)
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_bin;

-- The sample of the tables that Outbox.Run takes for the metrics, and the service's configuration
-- for the operators' tools: one row.
CREATE TABLE IF NOT EXISTS `{{schema}}`.`{{prefix}}stats` (
    id                    INT         NOT NULL,
    leased_at             DATETIME(6) NOT NULL,
    sampled_at            DATETIME(6) NULL,
    sample                TEXT        NULL,
    retention_ms          BIGINT      NULL,
    effect_retention_ms   BIGINT      NULL,
    redelivery_horizon_ms BIGINT      NULL,
    config_at             DATETIME(6) NULL,
    PRIMARY KEY (id)
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_bin;

INSERT IGNORE INTO `{{schema}}`.`{{prefix}}stats` (id, leased_at) VALUES (1, '1970-01-01 00:00:00');

-- Row locks that stand for the advisory locks of PostgreSQL: cleanup takes its row FOR UPDATE
-- SKIP LOCKED, so that only one process cleans at a time and the others skip.
CREATE TABLE IF NOT EXISTS `{{schema}}`.`{{prefix}}locks` (
    name VARCHAR(64) NOT NULL,
    PRIMARY KEY (name)
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_bin;

INSERT IGNORE INTO `{{schema}}`.`{{prefix}}locks` (name) VALUES ('cleanup');

-- Who changed what with the operators' tools (unpark, discard, replay).
CREATE TABLE IF NOT EXISTS `{{schema}}`.`{{prefix}}audit` (
    id          BIGINT       NOT NULL AUTO_INCREMENT,
    at          DATETIME(6)  NOT NULL,
    actor       TEXT         NOT NULL,
    action      TEXT         NOT NULL,
    target      TEXT         NOT NULL,
    detail      TEXT         NOT NULL,
    remote_addr TEXT         NOT NULL,
    db_user     VARCHAR(288) NOT NULL,
    PRIMARY KEY (id)
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_bin;
