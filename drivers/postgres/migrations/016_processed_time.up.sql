-- Cleanup finds expired claims through a B-tree on processed_at instead of the BRIN index of
-- migration 001. A BRIN summary only widens: once a cleanup has freed pages and new claims have
-- filled them, a range's summary spans the oldest claim it ever held to now, so every range
-- "may hold" an expired claim and each batch of a cleanup read the table from its first page
-- until it had found its thousand (and the ranges that earlier batches of the same pass had
-- emptied, again at every batch). Each new claim in such a range also rewrote its summary: one
-- BRIN record per claim, about the size of this index's entry. The B-tree's entries are read in
-- order and only as far as the batch goes.
--
-- CREATE INDEX blocks writes to the claim table while it builds (about a second per three million
-- claims on a small machine). On a large table, build it beforehand without blocking:
--   CREATE INDEX CONCURRENTLY IF NOT EXISTS "<prefix>processed_time" ON "<schema>"."<prefix>processed" (processed_at);
-- (docs/operations.md, "Upgrading"); this migration then finds it. A concurrent build that
-- failed leaves an invalid index of that name, which is dropped and built again here.
SET LOCAL lock_timeout = '10s';
DO $$
BEGIN
    IF EXISTS (SELECT 1 FROM pg_index i
        JOIN pg_class c ON c.oid = i.indexrelid
        JOIN pg_namespace s ON s.oid = c.relnamespace
        WHERE s.nspname = '{{schema}}' AND c.relname = '{{prefix}}processed_time' AND NOT i.indisvalid) THEN
        DROP INDEX "{{schema}}"."{{prefix}}processed_time";
    END IF;
END $$;
CREATE INDEX IF NOT EXISTS "{{prefix}}processed_time"
    ON "{{schema}}"."{{prefix}}processed" (processed_at);
DROP INDEX IF EXISTS "{{schema}}"."{{prefix}}processed_processed_at";
