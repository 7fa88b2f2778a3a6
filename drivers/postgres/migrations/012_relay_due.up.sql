-- The effects the relay may send: pending and not parked. A claim's window starts at the first of
-- them, found here, so that parked effects, which sit at the front of the pending ones (they are
-- the oldest), are not walked by every relay pass: a million of them cost 550 claims and 0.7 s
-- per pass on every instance. They still hold back the later effects of their ordering key: the
-- claim looks for a key's earlier effects among all pending ones.
CREATE INDEX IF NOT EXISTS "{{prefix}}effects_due"
    ON "{{schema}}"."{{prefix}}effects" (id) WHERE dispatched_at IS NULL AND parked_at IS NULL;
