-- Room on each page of the effects table for the updates of its rows. An effect row is updated
-- while it waits (the relay's lease of its key's first effect, a failure recorded), and such an
-- update is HOT (no index entry written, the old version pruned from its page without a vacuum)
-- only when the new version fits on the old one's page. With the default fillfactor of 100 every
-- page was filled by the inserts, and a relay that drained a backlog wrote 93% of its leases as
-- non-HOT updates: a new version on another page and an entry in each of the four indexes (the
-- primary key and the three partial indexes of pending effects the relay reads), dead once the
-- effect is sent. At 50 every lease of that drain was HOT (TestWritesPerMessage/relay; 70: 85%,
-- 90: 28%). The table holds only what is pending, so the space this costs is that of a backlog,
-- twice over; the dispatched table is never updated and keeps the default.
-- The setting takes effect on pages filled from now on; it takes a lock that blocks no reads or
-- writes of the rows, only other schema changes and vacuum.
SET LOCAL lock_timeout = '10s';
ALTER TABLE "{{schema}}"."{{prefix}}effects" SET (fillfactor = 50);
