-- The dispatched effects' archive (EffectRetention) is cleaned as the claims are since migration
-- 016, through a B-tree on dispatched_at walked in order, instead of the BRIN index of migration
-- 005, whose summaries, once cleanup had freed pages that newly archived effects filled, led each
-- batch of a cleanup through the whole table. The table is empty unless EffectRetention is set.
-- Like 016, CREATE INDEX blocks writes to the table (the marks that archive) while it builds; on a
-- large archive build it beforehand without blocking (docs/operations.md):
--   CREATE INDEX CONCURRENTLY IF NOT EXISTS "<prefix>dispatched_time" ON "<schema>"."<prefix>dispatched" (dispatched_at);
SET LOCAL lock_timeout = '10s';
DO $$
BEGIN
    IF EXISTS (SELECT 1 FROM pg_index i
        JOIN pg_class c ON c.oid = i.indexrelid
        JOIN pg_namespace s ON s.oid = c.relnamespace
        WHERE s.nspname = '{{schema}}' AND c.relname = '{{prefix}}dispatched_time' AND NOT i.indisvalid) THEN
        DROP INDEX "{{schema}}"."{{prefix}}dispatched_time";
    END IF;
END $$;
CREATE INDEX IF NOT EXISTS "{{prefix}}dispatched_time"
    ON "{{schema}}"."{{prefix}}dispatched" (dispatched_at);
DROP INDEX IF EXISTS "{{schema}}"."{{prefix}}dispatched_dispatched_at";
