-- Side effects kept inline in the claim until they are sent (the pgx driver's optimistic mode):
-- one row written per message instead of a claim and an effect row. The column is cleared (a HOT
-- update: it is in no index) when the effects are sent; the relay moves the ones left behind into
-- effect rows, scanning the claims written since swept_to (through the BRIN index on
-- processed_at). Cleanup never deletes a claim whose effects are still inline.
ALTER TABLE "{{schema}}"."{{prefix}}processed" ADD COLUMN IF NOT EXISTS effects bytea;
ALTER TABLE "{{schema}}"."{{prefix}}stats" ADD COLUMN IF NOT EXISTS swept_to timestamptz;
-- No claim written before this migration holds inline effects.
UPDATE "{{schema}}"."{{prefix}}stats" SET swept_to = now() WHERE id = 1 AND swept_to IS NULL;
