-- The UUID of a dead-lettered message, which a retry publishes it with again: a consumer that reads
-- its message ID from the metadata (or stores a message it cannot identify under a derived ID)
-- keys the dead letter by an ID that is not the message's UUID, and a copy republished under a new
-- UUID is no duplicate to the topic's other consumers. NULL for a dead letter stored before: its
-- retry uses the message ID, as before. Nullable, without a default: adding it rewrites nothing.
-- It waits for the table's lock at most 10 s, as 015 does: behind a transaction that does not end
-- it gives up (Migrate fails, and does it at the next start) rather than hold back every dead
-- letter stored meanwhile.
SET LOCAL lock_timeout = '10s';
ALTER TABLE "{{schema}}"."{{prefix}}dead_letters" ADD COLUMN IF NOT EXISTS message_uuid text;
