-- An insert of effects with an ordering key of their own looks for the delayed effects of that
-- key that are due and not moved yet, to move them ahead of its rows (see the PostgreSQL
-- migration of the same name): one probe of this index per insert.
CREATE INDEX IF NOT EXISTS "{{schema}}"."{{prefix}}delayed_key"
    ON "{{prefix}}delayed" (ordering_key, due_at);
