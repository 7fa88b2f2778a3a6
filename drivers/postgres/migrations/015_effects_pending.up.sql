-- Dispatched effects leave the effects table (deleted, or moved to the dispatched table since
-- migration 005), so every row in it is pending and effects_pending, (id) WHERE dispatched_at IS
-- NULL, holds the same entries as the primary key: one more index entry written (and WAL-logged)
-- for every recorded effect, read by nothing the primary key does not serve as well.
DROP INDEX IF EXISTS "{{schema}}"."{{prefix}}effects_pending";
