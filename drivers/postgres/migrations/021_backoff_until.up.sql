-- The retry time a recorded failure gave an effect, beside next_attempt_at, which a relay's lease
-- and a release overwrite: an effect backs off while the two are equal and still ahead. Once its
-- destination takes a message again, the relay makes such effects due at once; a leased one (its
-- lease ends after the retry time it was claimed past, so never equal) is left alone. A nullable
-- column without a default: the table is not rewritten.
SET LOCAL lock_timeout = '10s';
-- Checked first rather than with ADD COLUMN IF NOT EXISTS: a script that applies every migration
-- again (migrate sql) finds the effects table a partition after 023, and a partition refuses
-- ADD COLUMN even when the column exists.
DO $$
BEGIN
IF NOT EXISTS (SELECT 1 FROM pg_attribute WHERE attrelid = '"{{schema}}"."{{prefix}}effects"'::regclass
    AND attname = 'backoff_until' AND NOT attisdropped) THEN
    ALTER TABLE "{{schema}}"."{{prefix}}effects" ADD COLUMN backoff_until timestamptz;
END IF;
END $$;
