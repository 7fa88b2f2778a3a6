-- The UUID of a dead-lettered message, which a retry publishes it with again (see the PostgreSQL
-- migration of the same name). MySQL has no ADD COLUMN IF NOT EXISTS: the statement is chosen by
-- whether the column is there, so that the migration can run again.
SET @outbox_dead_letter_uuid = (SELECT IF(EXISTS (SELECT 1 FROM information_schema.columns
        WHERE table_schema = coalesce(nullif('{{schema}}', ''), database()) AND table_name = '{{prefix}}dead_letters' AND column_name = 'message_uuid'),
    'DO 0',
    'ALTER TABLE `{{schema}}`.`{{prefix}}dead_letters` ADD COLUMN message_uuid TEXT NULL'));
PREPARE outbox_dead_letter_uuid FROM @outbox_dead_letter_uuid;
EXECUTE outbox_dead_letter_uuid;
DEALLOCATE PREPARE outbox_dead_letter_uuid;
