-- An operator's request to dead-letter a failing message at once (see the PostgreSQL migration of
-- the same name). MySQL has no ADD COLUMN IF NOT EXISTS: the statement is chosen by whether the
-- column is there (in the connection's database when no schema is named), so that the migration
-- can run again.
SET @outbox_dead_letter_now = (SELECT IF(EXISTS (SELECT 1 FROM information_schema.columns
        WHERE table_schema = coalesce(nullif('{{schema}}', ''), database()) AND table_name = '{{prefix}}attempts' AND column_name = 'dead_letter_by'),
    'DO 0',
    'ALTER TABLE `{{schema}}`.`{{prefix}}attempts` ADD COLUMN dead_letter_by TEXT NULL'));
PREPARE outbox_dead_letter_now FROM @outbox_dead_letter_now;
EXECUTE outbox_dead_letter_now;
DEALLOCATE PREPARE outbox_dead_letter_now;
