-- The relay's sweep of inline effects left behind keeps where it got to as a transaction ID, not
-- as a time: a claim's time is taken before its commit (which may wait on a lock held by a copy
-- for as long as HandlerTimeout), and a time written by one server's clock means nothing to
-- another's after a failover. A claim with inline effects records the ID of the transaction that
-- wrote it (pg_current_xact_id(), as a bigint: PostgreSQL has no BRIN operator class for xid8);
-- every transaction with a smaller ID than the oldest one running at a sweep has ended, so that
-- a sweep cannot miss a claim that commits after it, whenever it commits.
--
-- The BRIN index costs next to nothing per insert and leaves the update that clears the effects
-- once they are sent a HOT update (it does not change inline_xid); a partial index on claims
-- holding effects would make every such update write index entries. Ranges are summarized as
-- soon as they are full (autosummarize), not at the next vacuum, so that a sweep reads the claims
-- from where it got to rather than every page written since the last vacuum.
ALTER TABLE "{{schema}}"."{{prefix}}processed" ADD COLUMN IF NOT EXISTS inline_xid bigint;
CREATE INDEX IF NOT EXISTS "{{prefix}}processed_inline_xid"
    ON "{{schema}}"."{{prefix}}processed" USING brin (inline_xid) WITH (autosummarize = on);
-- Below it, every claim with inline effects was moved, sent or set aside.
ALTER TABLE "{{schema}}"."{{prefix}}stats" ADD COLUMN IF NOT EXISTS swept_xid bigint;
-- Claims written before this version that still hold effects are stamped with this transaction's
-- ID, so that the next sweep finds them. Older ones than the earlier sweep's look-back (one
-- minute behind where it got to) had been moved already. Found through the BRIN index on
-- processed_at.
UPDATE "{{schema}}"."{{prefix}}processed" SET inline_xid = pg_current_xact_id()::text::bigint
WHERE effects IS NOT NULL AND inline_xid IS NULL
  AND processed_at >= (SELECT least(coalesce(swept_to, '-infinity'), now()) - interval '1 minute'
                       FROM "{{schema}}"."{{prefix}}stats" WHERE id = 1);
