-- When the last failed dispatch of an effect was recorded.
-- Checked first rather than with ADD COLUMN IF NOT EXISTS: a script that applies every migration
-- again (migrate sql) finds the effects table a partition after 023, and a partition refuses
-- ADD COLUMN even when the column exists.
DO $$
BEGIN
IF NOT EXISTS (SELECT 1 FROM pg_attribute WHERE attrelid = '"{{schema}}"."{{prefix}}effects"'::regclass
    AND attname = 'failed_at' AND NOT attisdropped) THEN
    ALTER TABLE "{{schema}}"."{{prefix}}effects" ADD COLUMN failed_at timestamptz;
END IF;
END $$;
