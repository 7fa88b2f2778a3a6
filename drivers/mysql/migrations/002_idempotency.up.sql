-- The idempotency keys of keyed units of work at the boundary (see the PostgreSQL migration of the
-- same name). A key is claimed in the transaction of the business change, under GET_LOCK of its
-- name held until that transaction has ended, so that a retry while the first request runs is
-- told at once (or waits for its outcome). The expiry is written with each key at its claim.
-- `key` is a reserved word: every statement quotes it.
CREATE TABLE IF NOT EXISTS `{{schema}}`.`{{prefix}}idempotency` (
    scope       VARCHAR(255) NOT NULL,
    `key`       VARCHAR(255) NOT NULL,
    fingerprint LONGBLOB     NOT NULL,
    result      LONGBLOB     NOT NULL,
    created_at  DATETIME(6)  NOT NULL,
    expires_at  DATETIME(6)  NOT NULL,
    PRIMARY KEY (scope, `key`),
    KEY idempotency_expiry (expires_at)
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_bin;
