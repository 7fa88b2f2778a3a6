-- An insert of effects with an ordering key moves the delayed effects of that key that are due
-- and not moved yet ahead of them (a due delayed effect is never overtaken by an effect of its
-- key recorded after): one probe of this index per insert, which finds nothing unless one is due.
-- The delayed table holds only what is waiting, so the index builds in moments.
SET LOCAL lock_timeout = '10s';
CREATE INDEX IF NOT EXISTS "{{prefix}}delayed_key"
    ON "{{schema}}"."{{prefix}}delayed" (ordering_key, due_at);
