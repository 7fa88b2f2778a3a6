-- Dispatched effects leave the effects table (deleted, or moved to the dispatched table since
-- migration 005), so every row in it is pending and effects_pending, (id) WHERE dispatched_at IS
-- NULL, holds the same entries as the primary key: one more index entry written (and WAL-logged)
-- for every recorded effect, read by nothing the primary key does not serve as well.
-- DROP INDEX waits for the transactions that use the table and holds back new ones meanwhile:
-- behind a long transaction it gives up after lock_timeout (the migration fails, and runs again at
-- the next Migrate) rather than stall every unit of work.
SET LOCAL lock_timeout = '10s';
DROP INDEX IF EXISTS "{{schema}}"."{{prefix}}effects_pending";
