-- Failed dispatches: failures counts every one (the retry backoff grows with it), attempts only
-- those that count toward parking (a failure while nothing else reached the broker is an outage,
-- not a poison effect).
-- Checked first rather than with ADD COLUMN IF NOT EXISTS: a script that applies every migration
-- again (migrate sql) finds the effects table a partition after 023, and a partition refuses
-- ADD COLUMN even when the column exists.
DO $$
BEGIN
IF NOT EXISTS (SELECT 1 FROM pg_attribute WHERE attrelid = '"{{schema}}"."{{prefix}}effects"'::regclass
    AND attname = 'failures' AND NOT attisdropped) THEN
    ALTER TABLE "{{schema}}"."{{prefix}}effects" ADD COLUMN failures integer NOT NULL DEFAULT 0;
END IF;
END $$;
