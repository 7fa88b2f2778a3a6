-- An insert of effects with an ordering key looks for the delayed effects of that key that are
-- due and not moved yet, to move them ahead of its rows (see the PostgreSQL migration of the same
-- name): one probe of this index per insert, which finds nothing unless one is due. The delayed
-- table holds only what is waiting, so the copy is short. MySQL has no ADD KEY IF NOT EXISTS: the
-- statement is chosen by whether the index is there (in the connection's database when no schema
-- is named), so that the migration can run again.
SET @outbox_delayed_key = (SELECT IF(EXISTS (SELECT 1 FROM information_schema.statistics
        WHERE table_schema = coalesce(nullif('{{schema}}', ''), database()) AND table_name = '{{prefix}}delayed' AND index_name = 'delayed_key'),
    'DO 0',
    'ALTER TABLE `{{schema}}`.`{{prefix}}delayed` ADD KEY delayed_key (ordering_key, due_at)'));
PREPARE outbox_delayed_key FROM @outbox_delayed_key;
EXECUTE outbox_delayed_key;
DEALLOCATE PREPARE outbox_delayed_key;
