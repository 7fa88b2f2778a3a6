-- The effects table is a queue: rows are inserted, then deleted once sent. While a long
-- transaction, a session idle in transaction or a replication slot holds the xmin horizon back,
-- deleted rows cannot be vacuumed nor their index entries killed, and the relay's claim (the
-- first pending effect, through effects_due, and the window from there) walked every dead entry
-- since the hold began: measured at 400 effects/s, 1.3 ms per claim became 353 ms after eight
-- minutes. So the effects are split into three partitions by generation (gen), one of them
-- current: the relay empties the oldest, moving what is still pending in it (parked, backing
-- off) into the current one, and TRUNCATEs it, which frees its rows and index entries whatever
-- holds the horizon; then it makes it the current one (drivers/postgres, rotate).
--
-- A rolling upgrade: the existing table keeps its name, rows and indexes and becomes partition 0
-- of a new parent, effects_all, through which this version reads, updates and deletes. The
-- statements of an earlier version name effects itself and keep working on it: a plain
-- partition accepts RETURNING xmin (a partitioned table refuses system columns there), its
-- default for gen (0) satisfies its bound, and the relay of this version sends what they write
-- through the parent. Partitions 1 and 2 are effects_1 and effects_2.
--
-- Nothing is rewritten: the new column has a constant default, the CHECK lets ATTACH skip its
-- scan, and the parent's indexes adopt the existing ones. ADD COLUMN and ATTACH wait for the
-- transactions that use the table and hold back new ones meanwhile: behind a long transaction
-- the migration gives up after lock_timeout (and runs again at the next Migrate) rather than
-- stall every unit of work.
SET LOCAL lock_timeout = '10s';
-- Done once: the migrations run again whenever their record is missing.
DO $$
BEGIN
IF NOT EXISTS (SELECT 1 FROM pg_class c JOIN pg_namespace s ON s.oid = c.relnamespace
    WHERE s.nspname = '{{schema}}' AND c.relname = '{{prefix}}effects_all') THEN
    ALTER TABLE "{{schema}}"."{{prefix}}effects" ADD COLUMN gen smallint NOT NULL DEFAULT 0;
    ALTER TABLE "{{schema}}"."{{prefix}}effects" ADD CONSTRAINT "{{prefix}}effects_gen" CHECK (gen = 0);

    -- The current generation: one row. The relay switches it (UPDATE ... WHERE gen = <what it read>,
    -- so that one instance wins), and inserts through the parent read it for their default.
    CREATE TABLE "{{schema}}"."{{prefix}}effects_rotation" (
        gen        smallint    NOT NULL CHECK (gen IN (0, 1, 2)),
        rotated_at timestamptz NOT NULL
    );
    CREATE UNIQUE INDEX "{{prefix}}effects_rotation_one" ON "{{schema}}"."{{prefix}}effects_rotation" ((true));
    INSERT INTO "{{schema}}"."{{prefix}}effects_rotation" (gen, rotated_at) VALUES (0, now());
    CREATE FUNCTION "{{schema}}"."{{prefix}}effects_gen"() RETURNS smallint LANGUAGE sql STABLE
        AS $f$ SELECT gen FROM "{{schema}}"."{{prefix}}effects_rotation" $f$;

    -- The ids keep coming from the same sequence (the id default is copied), still owned by
    -- effects, which is never dropped.
    CREATE TABLE "{{schema}}"."{{prefix}}effects_all" (LIKE "{{schema}}"."{{prefix}}effects" INCLUDING DEFAULTS)
        PARTITION BY LIST (gen);
    ALTER TABLE "{{schema}}"."{{prefix}}effects_all" ALTER COLUMN gen SET DEFAULT "{{schema}}"."{{prefix}}effects_gen"();
    ALTER TABLE "{{schema}}"."{{prefix}}effects_all" ALTER COLUMN dispatched_at SET STATISTICS 0;
    ALTER TABLE "{{schema}}"."{{prefix}}effects_all" ATTACH PARTITION "{{schema}}"."{{prefix}}effects" FOR VALUES IN (0);

    -- Each partition has its own primary key on id (one on the parent would have to include gen),
    -- its own default for gen, for the inserts that name it, and half-filled pages (022).
    CREATE TABLE "{{schema}}"."{{prefix}}effects_1" PARTITION OF "{{schema}}"."{{prefix}}effects_all"
        (CONSTRAINT "{{prefix}}effects_1_pkey" PRIMARY KEY (id)) FOR VALUES IN (1) WITH (fillfactor = 50);
    CREATE TABLE "{{schema}}"."{{prefix}}effects_2" PARTITION OF "{{schema}}"."{{prefix}}effects_all"
        (CONSTRAINT "{{prefix}}effects_2_pkey" PRIMARY KEY (id)) FOR VALUES IN (2) WITH (fillfactor = 50);
    ALTER TABLE "{{schema}}"."{{prefix}}effects_1" ALTER COLUMN gen SET DEFAULT 1;
    ALTER TABLE "{{schema}}"."{{prefix}}effects_2" ALTER COLUMN gen SET DEFAULT 2;
    -- No statistics on dispatched_at (migration 004).
    ALTER TABLE "{{schema}}"."{{prefix}}effects_1" ALTER COLUMN dispatched_at SET STATISTICS 0;
    ALTER TABLE "{{schema}}"."{{prefix}}effects_2" ALTER COLUMN dispatched_at SET STATISTICS 0;

    -- The partitions' indexes, then the parent's, which adopt them (partition 0's are its
    -- existing ones, under their names: nothing is built again). The parent's names are short
    -- enough for a 40-byte prefix and differ from partition 0's.
    CREATE INDEX "{{prefix}}effects_1_source" ON "{{schema}}"."{{prefix}}effects_1" (source_consumer, source_id, seq) WHERE dispatched_at IS NULL;
    CREATE INDEX "{{prefix}}effects_2_source" ON "{{schema}}"."{{prefix}}effects_2" (source_consumer, source_id, seq) WHERE dispatched_at IS NULL;
    CREATE INDEX "{{prefix}}effects_1_key" ON "{{schema}}"."{{prefix}}effects_1" (ordering_key, id) WHERE dispatched_at IS NULL;
    CREATE INDEX "{{prefix}}effects_2_key" ON "{{schema}}"."{{prefix}}effects_2" (ordering_key, id) WHERE dispatched_at IS NULL;
    CREATE INDEX "{{prefix}}effects_1_parked" ON "{{schema}}"."{{prefix}}effects_1" (id) WHERE parked_at IS NOT NULL AND dispatched_at IS NULL;
    CREATE INDEX "{{prefix}}effects_2_parked" ON "{{schema}}"."{{prefix}}effects_2" (id) WHERE parked_at IS NOT NULL AND dispatched_at IS NULL;
    CREATE INDEX "{{prefix}}effects_1_due" ON "{{schema}}"."{{prefix}}effects_1" (id) WHERE dispatched_at IS NULL AND parked_at IS NULL;
    CREATE INDEX "{{prefix}}effects_2_due" ON "{{schema}}"."{{prefix}}effects_2" (id) WHERE dispatched_at IS NULL AND parked_at IS NULL;
    CREATE INDEX "{{prefix}}effects_all_source"
        ON "{{schema}}"."{{prefix}}effects_all" (source_consumer, source_id, seq) WHERE dispatched_at IS NULL;
    CREATE INDEX "{{prefix}}effects_all_key"
        ON "{{schema}}"."{{prefix}}effects_all" (ordering_key, id) WHERE dispatched_at IS NULL;
    CREATE INDEX "{{prefix}}effects_all_parked"
        ON "{{schema}}"."{{prefix}}effects_all" (id) WHERE parked_at IS NOT NULL AND dispatched_at IS NULL;
    CREATE INDEX "{{prefix}}effects_all_due"
        ON "{{schema}}"."{{prefix}}effects_all" (id) WHERE dispatched_at IS NULL AND parked_at IS NULL;
END IF;
END $$;
