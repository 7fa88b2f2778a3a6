-- Failed dispatches: failures counts every one (the retry backoff grows with it), attempts only
-- those that count toward parking (a failure while nothing else reached the broker is an outage,
-- not a poison effect).
ALTER TABLE "{{schema}}"."{{prefix}}effects" ADD COLUMN IF NOT EXISTS failures integer NOT NULL DEFAULT 0;
