-- The sample of the tables that Outbox.Run takes for the metrics: one process samples per
-- interval (it takes the lease), and every process reads the last sample, so that the cost
-- does not grow with the number of instances or scrapes.
CREATE TABLE IF NOT EXISTS "{{schema}}"."{{prefix}}stats" (
    id         integer     PRIMARY KEY CHECK (id = 1),
    leased_at  timestamptz NOT NULL,
    sampled_at timestamptz,
    sample     text
);
INSERT INTO "{{schema}}"."{{prefix}}stats" (id, leased_at) VALUES (1, '-infinity') ON CONFLICT (id) DO NOTHING;

-- Parked effects are few; the sample counts them and finds the oldest without reading the
-- pending ones.
CREATE INDEX IF NOT EXISTS "{{prefix}}effects_parked"
    ON "{{schema}}"."{{prefix}}effects" (id) WHERE parked_at IS NOT NULL AND dispatched_at IS NULL;
