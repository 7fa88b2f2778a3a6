-- The UUID of a dead-lettered message, which a retry publishes it with again (see the PostgreSQL
-- migration of the same name).
ALTER TABLE "{{schema}}"."{{prefix}}dead_letters" ADD COLUMN message_uuid TEXT;
