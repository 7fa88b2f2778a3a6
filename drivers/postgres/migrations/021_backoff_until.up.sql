-- The retry time a recorded failure gave an effect, beside next_attempt_at, which a relay's lease
-- and a release overwrite: an effect backs off while the two are equal and still ahead. Once its
-- destination takes a message again, the relay makes such effects due at once; a leased one (its
-- lease ends after the retry time it was claimed past, so never equal) is left alone. A nullable
-- column without a default: the table is not rewritten.
SET LOCAL lock_timeout = '10s';
ALTER TABLE "{{schema}}"."{{prefix}}effects" ADD COLUMN IF NOT EXISTS backoff_until timestamptz;
