-- Delayed side effects, kept apart from the pending ones until they are due (see the PostgreSQL
-- migration of the same name). The relay moves the due ones into the effects table, taking them
-- FOR UPDATE SKIP LOCKED: a unit of work that cancels one holds it, and its committed cancel
-- means it is never sent. MySQL has no partial index: the cancel keys' index holds NULLs too.
CREATE TABLE IF NOT EXISTS `{{schema}}`.`{{prefix}}delayed` (
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
    due_at          DATETIME(6)  NOT NULL,
    cancel_key      VARCHAR(255) NULL,
    PRIMARY KEY (id),
    KEY delayed_due (due_at, id),
    KEY delayed_cancel (cancel_key)
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_bin;
