-- An operator's request to dead-letter a failing message at once (see the PostgreSQL migration of
-- the same name).
ALTER TABLE "{{schema}}"."{{prefix}}attempts" ADD COLUMN dead_letter_by TEXT;
