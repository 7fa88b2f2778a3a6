-- Indexes for cleanup's batches: without them each batch scanned the effects kept for
-- EffectRetention, and the attempt counters, whole, holding the database's only write lock
-- (BEGIN IMMEDIATE) while it did, and every unit of work waited for it.
CREATE INDEX IF NOT EXISTS "{{schema}}"."{{prefix}}effects_dispatched"
    ON "{{prefix}}effects" (dispatched_at) WHERE dispatched_at IS NOT NULL;
CREATE INDEX IF NOT EXISTS "{{schema}}"."{{prefix}}attempts_failed_at"
    ON "{{prefix}}attempts" (last_failed_at);
