-- The effects table is a queue: rows are inserted, then deleted once sent. While a long
-- transaction, a session idle in transaction or a replication slot holds the xmin horizon back,
-- deleted rows cannot be vacuumed nor their index entries killed, and the relay's claim (the
-- first pending effect, through effects_due, and the window from there) walked every dead entry
-- since the hold began: measured at 400 effects/s, 1.3 ms per claim became 353 ms after eight
-- minutes. So the table is split into three partitions by generation (gen), one of them
-- current: the relay empties the oldest, moving what is still pending in it (parked, backing
-- off) into the current one, and TRUNCATEs it, which frees its rows and index entries whatever
-- holds the horizon; then it makes it the current one (drivers/postgres, rotate).
--
-- Every statement keeps reading, updating and deleting through the parent, under its old name.
-- Inserts that return xmin (to tell rows written inside a savepoint) name the current partition
-- itself, because PostgreSQL refuses system columns in RETURNING on a partitioned table; the
-- others go through the parent, whose default for gen is the current generation.
--
-- The existing table becomes partition 0 with its rows and indexes: nothing is rewritten (the
-- CHECK lets ATTACH skip its scan, and the parent's indexes adopt the existing ones). The
-- renames and the ATTACH wait for the transactions that use the table and hold back new ones
-- meanwhile: behind a long transaction the migration gives up after lock_timeout (and runs again
-- at the next Migrate) rather than stall every unit of work.
SET LOCAL lock_timeout = '10s';
-- Done once: the migrations run again whenever their record is missing.
DO $$
BEGIN
IF NOT EXISTS (SELECT 1 FROM pg_class c JOIN pg_namespace s ON s.oid = c.relnamespace
    WHERE s.nspname = '{{schema}}' AND c.relname = '{{prefix}}effects' AND c.relkind = 'p') THEN
    ALTER TABLE "{{schema}}"."{{prefix}}effects" RENAME TO "{{prefix}}effects_0";
    ALTER INDEX "{{schema}}"."{{prefix}}effects_pkey" RENAME TO "{{prefix}}effects_0_pkey";
    ALTER INDEX "{{schema}}"."{{prefix}}effects_pending_source" RENAME TO "{{prefix}}effects_0_source";
    ALTER INDEX "{{schema}}"."{{prefix}}effects_pending_key" RENAME TO "{{prefix}}effects_0_key";
    ALTER INDEX "{{schema}}"."{{prefix}}effects_parked" RENAME TO "{{prefix}}effects_0_parked";
    ALTER INDEX "{{schema}}"."{{prefix}}effects_due" RENAME TO "{{prefix}}effects_0_due";
    ALTER TABLE "{{schema}}"."{{prefix}}effects_0" ADD COLUMN gen smallint NOT NULL DEFAULT 0;
    ALTER TABLE "{{schema}}"."{{prefix}}effects_0" ADD CONSTRAINT "{{prefix}}effects_0_gen" CHECK (gen = 0);

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

    CREATE TABLE "{{schema}}"."{{prefix}}effects" (LIKE "{{schema}}"."{{prefix}}effects_0" INCLUDING DEFAULTS)
        PARTITION BY LIST (gen);
    ALTER TABLE "{{schema}}"."{{prefix}}effects" ALTER COLUMN gen SET DEFAULT "{{schema}}"."{{prefix}}effects_gen"();
    ALTER TABLE "{{schema}}"."{{prefix}}effects" ALTER COLUMN dispatched_at SET STATISTICS 0;
    -- The ids keep coming from the same sequence, now owned by the parent (pg_get_serial_sequence
    -- reads the owner).
    ALTER SEQUENCE "{{schema}}"."{{prefix}}effects_id_seq" OWNED BY "{{schema}}"."{{prefix}}effects".id;
    ALTER TABLE "{{schema}}"."{{prefix}}effects" ATTACH PARTITION "{{schema}}"."{{prefix}}effects_0" FOR VALUES IN (0);

    -- Each partition has its own primary key on id (one on the parent would have to include gen) and
    -- its own default for gen, for the inserts that name it.
    CREATE TABLE "{{schema}}"."{{prefix}}effects_1" PARTITION OF "{{schema}}"."{{prefix}}effects"
        (CONSTRAINT "{{prefix}}effects_1_pkey" PRIMARY KEY (id)) FOR VALUES IN (1);
    CREATE TABLE "{{schema}}"."{{prefix}}effects_2" PARTITION OF "{{schema}}"."{{prefix}}effects"
        (CONSTRAINT "{{prefix}}effects_2_pkey" PRIMARY KEY (id)) FOR VALUES IN (2);
    ALTER TABLE "{{schema}}"."{{prefix}}effects_0" ALTER COLUMN gen SET DEFAULT 0;
    ALTER TABLE "{{schema}}"."{{prefix}}effects_1" ALTER COLUMN gen SET DEFAULT 1;
    ALTER TABLE "{{schema}}"."{{prefix}}effects_2" ALTER COLUMN gen SET DEFAULT 2;
    -- No statistics on dispatched_at (migration 004).
    ALTER TABLE "{{schema}}"."{{prefix}}effects_1" ALTER COLUMN dispatched_at SET STATISTICS 0;
    ALTER TABLE "{{schema}}"."{{prefix}}effects_2" ALTER COLUMN dispatched_at SET STATISTICS 0;

    -- The partitions' indexes with names of their own, then the parent's under the old names, which
    -- adopt them (partition 0's were built already: nothing is built again).
    CREATE INDEX "{{prefix}}effects_1_source" ON "{{schema}}"."{{prefix}}effects_1" (source_consumer, source_id, seq) WHERE dispatched_at IS NULL;
    CREATE INDEX "{{prefix}}effects_2_source" ON "{{schema}}"."{{prefix}}effects_2" (source_consumer, source_id, seq) WHERE dispatched_at IS NULL;
    CREATE INDEX "{{prefix}}effects_1_key" ON "{{schema}}"."{{prefix}}effects_1" (ordering_key, id) WHERE dispatched_at IS NULL;
    CREATE INDEX "{{prefix}}effects_2_key" ON "{{schema}}"."{{prefix}}effects_2" (ordering_key, id) WHERE dispatched_at IS NULL;
    CREATE INDEX "{{prefix}}effects_1_parked" ON "{{schema}}"."{{prefix}}effects_1" (id) WHERE parked_at IS NOT NULL AND dispatched_at IS NULL;
    CREATE INDEX "{{prefix}}effects_2_parked" ON "{{schema}}"."{{prefix}}effects_2" (id) WHERE parked_at IS NOT NULL AND dispatched_at IS NULL;
    CREATE INDEX "{{prefix}}effects_1_due" ON "{{schema}}"."{{prefix}}effects_1" (id) WHERE dispatched_at IS NULL AND parked_at IS NULL;
    CREATE INDEX "{{prefix}}effects_2_due" ON "{{schema}}"."{{prefix}}effects_2" (id) WHERE dispatched_at IS NULL AND parked_at IS NULL;
    CREATE INDEX "{{prefix}}effects_pending_source"
        ON "{{schema}}"."{{prefix}}effects" (source_consumer, source_id, seq) WHERE dispatched_at IS NULL;
    CREATE INDEX "{{prefix}}effects_pending_key"
        ON "{{schema}}"."{{prefix}}effects" (ordering_key, id) WHERE dispatched_at IS NULL;
    CREATE INDEX "{{prefix}}effects_parked"
        ON "{{schema}}"."{{prefix}}effects" (id) WHERE parked_at IS NOT NULL AND dispatched_at IS NULL;
    CREATE INDEX "{{prefix}}effects_due"
        ON "{{schema}}"."{{prefix}}effects" (id) WHERE dispatched_at IS NULL AND parked_at IS NULL;
END IF;
END $$;
