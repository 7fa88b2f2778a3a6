-- Failed dispatches: failures counts every one (the retry backoff grows with it), attempts only
-- those that count toward parking (a failure while nothing else reached the broker is an outage,
-- not a poison effect). SQLite has no ADD COLUMN IF NOT EXISTS: one statement per migration, and
-- the migrator takes "duplicate column name" for "already applied".
ALTER TABLE "{{schema}}"."{{prefix}}effects" ADD COLUMN failures INTEGER NOT NULL DEFAULT 0;
