-- The retry time a recorded failure gave an effect, beside next_attempt_at, which a relay's lease
-- and a release overwrite (see the PostgreSQL migration of the same name). MySQL has no ADD
-- COLUMN IF NOT EXISTS: the statement is chosen by whether the column is there, so that the
-- migration can run again.
SET @outbox_backoff_until = (SELECT IF(EXISTS (SELECT 1 FROM information_schema.columns
        WHERE table_schema = coalesce(nullif('{{schema}}', ''), database()) AND table_name = '{{prefix}}effects' AND column_name = 'backoff_until'),
    'DO 0',
    'ALTER TABLE `{{schema}}`.`{{prefix}}effects` ADD COLUMN backoff_until DATETIME(6) NULL'));
PREPARE outbox_backoff_until FROM @outbox_backoff_until;
EXECUTE outbox_backoff_until;
DEALLOCATE PREPARE outbox_backoff_until;
