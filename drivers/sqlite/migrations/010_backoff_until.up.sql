-- The retry time a recorded failure gave an effect, beside next_attempt_at, which a relay's lease
-- and a release overwrite (see the PostgreSQL migration of the same name).
ALTER TABLE "{{schema}}"."{{prefix}}effects" ADD COLUMN backoff_until TIMESTAMP;
