-- Room on each page for the updates of the rows on it. An update is HOT (no index entry written,
-- the old version pruned from its page without a vacuum) only when the new version fits on the
-- old one's page; otherwise it writes an entry in every index of the table, dead at the row's
-- next update or delete.
--
-- An effect row is updated while it waits (the relay's lease of its key's first effect, a failure
-- recorded). With the default fillfactor of 100 the inserts filled every page, and a relay that
-- drained a backlog wrote 93% of its leases as non-HOT updates, each with an entry in the primary
-- key and the three partial indexes of pending effects that the relay's claims read. At 50 every
-- lease of that drain was HOT (TestWritesPerMessage; 70: 85%, 90: 28%); of a drain of 30,000
-- effects on 300 keys, 33% at 100 and all at 50. The table holds only what
-- is pending, so the space this costs is that of a backlog, twice over; the dispatched table is
-- never updated and keeps the default.
--
-- A claim of the database/sql form is written once per record of its unit (its effects kept in
-- it), and at its commit its page holds every version of it: with two effects of 600 bytes, its
-- insert and versions of 0.7 and 1.3 KB. At the claims' fillfactor of 90, 11% of those updates
-- were non-HOT, one message in three; at 80 none (up to two effects of 800 bytes one message at a
-- time, 99% with 600 bytes and eight at a time), for a claim table an eighth larger.
--
-- The settings apply to the pages filled from now on; they take a lock that blocks no reads or
-- writes of rows, only schema changes and vacuum.
SET LOCAL lock_timeout = '10s';
ALTER TABLE "{{schema}}"."{{prefix}}effects" SET (fillfactor = 50);
ALTER TABLE "{{schema}}"."{{prefix}}processed" SET (fillfactor = 80);
