-- What a running service records of its configuration (Outbox.Run, before each cleanup pass),
-- so that the operator's tools know it: `outbox cleanup` refuses a retention shorter than the
-- service's, or than its broker's redelivery horizon, without -force. NULL until a service records
-- it.
ALTER TABLE "{{schema}}"."{{prefix}}stats" ADD COLUMN IF NOT EXISTS retention_ms bigint;
ALTER TABLE "{{schema}}"."{{prefix}}stats" ADD COLUMN IF NOT EXISTS effect_retention_ms bigint;
ALTER TABLE "{{schema}}"."{{prefix}}stats" ADD COLUMN IF NOT EXISTS redelivery_horizon_ms bigint;
ALTER TABLE "{{schema}}"."{{prefix}}stats" ADD COLUMN IF NOT EXISTS config_at timestamptz;
