-- The sample of the tables that Outbox.Run takes for the metrics (see the PostgreSQL migration).
CREATE TABLE IF NOT EXISTS "{{schema}}"."{{prefix}}stats" (
    id         INTEGER   PRIMARY KEY CHECK (id = 1),
    leased_at  TIMESTAMP NOT NULL,
    sampled_at TIMESTAMP,
    sample     TEXT
);
INSERT INTO "{{schema}}"."{{prefix}}stats" (id, leased_at) VALUES (1, '0000-01-01 00:00:00.000') ON CONFLICT (id) DO NOTHING;

CREATE INDEX IF NOT EXISTS "{{schema}}"."{{prefix}}effects_parked"
    ON "{{prefix}}effects" (id) WHERE parked_at IS NOT NULL AND dispatched_at IS NULL;
