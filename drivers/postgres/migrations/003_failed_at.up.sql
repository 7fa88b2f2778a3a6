-- When the last failed dispatch of an effect was recorded.
ALTER TABLE "{{schema}}"."{{prefix}}effects" ADD COLUMN IF NOT EXISTS failed_at timestamptz;
