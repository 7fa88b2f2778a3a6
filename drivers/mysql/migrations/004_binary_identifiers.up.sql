-- Identifiers compare byte for byte, as on PostgreSQL. utf8mb4_bin, the collation of the tables
-- of 001-003, is PAD SPACE: 'a' = 'a ' there, in comparisons and in keys, so that a message whose
-- ID is another's plus a trailing space was taken for its duplicate, an idempotency key replayed
-- another's result and a cancel key cancelled another's effects. The identifier columns become
-- binary strings, which neither pad nor fold on MySQL 8 and MariaDB alike (no NO PAD collation
-- has one name on both): message IDs, consumers, ordering keys, idempotency scopes and keys,
-- cancel keys as VARBINARY, topics as BLOB (TEXT's binary twin). The stored bytes stay as they
-- were: the connection's character set is utf8mb4 (DSNParams), so an argument's bytes are the
-- UTF-8 the columns held. VARBINARY(1020) is the byte length of VARCHAR(255) in utf8mb4: no stored
-- value can be cut, and the indexes are no longer than they were (the framework stores at most 255
-- bytes).
--
-- Each ALTER copies its table, and writes to it wait for the copy (reads go on): see
-- docs/operations.md. Run again on converted tables, each changes nothing.
ALTER TABLE `{{schema}}`.`{{prefix}}processed`
    MODIFY consumer   VARBINARY(1020) NOT NULL,
    MODIFY message_id VARBINARY(1020) NOT NULL;

ALTER TABLE `{{schema}}`.`{{prefix}}attempts`
    MODIFY consumer   VARBINARY(1020) NOT NULL,
    MODIFY message_id VARBINARY(1020) NOT NULL;

ALTER TABLE `{{schema}}`.`{{prefix}}effects`
    MODIFY source_consumer VARBINARY(1020) NOT NULL,
    MODIFY source_id       VARBINARY(1020) NOT NULL,
    MODIFY topic           BLOB            NOT NULL,
    MODIFY ordering_key    VARBINARY(1020) NOT NULL;

ALTER TABLE `{{schema}}`.`{{prefix}}idempotency`
    MODIFY scope VARBINARY(1020) NOT NULL,
    MODIFY `key` VARBINARY(1020) NOT NULL;

ALTER TABLE `{{schema}}`.`{{prefix}}delayed`
    MODIFY source_consumer VARBINARY(1020) NOT NULL,
    MODIFY source_id       VARBINARY(1020) NOT NULL,
    MODIFY topic           BLOB            NOT NULL,
    MODIFY ordering_key    VARBINARY(1020) NOT NULL,
    MODIFY cancel_key      VARBINARY(1020) NULL;
