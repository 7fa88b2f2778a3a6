-- An operator's request to dead-letter a failing message at once (outbox dead now): who asked.
-- The next delivery of the message stores it as a dead letter and acks it instead of running the
-- handler again. Nullable, without a default: adding it rewrites nothing.
ALTER TABLE "{{schema}}"."{{prefix}}attempts" ADD COLUMN IF NOT EXISTS dead_letter_by text;
