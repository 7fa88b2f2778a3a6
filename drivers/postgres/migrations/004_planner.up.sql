-- No statistics on dispatched_at. The relay's statements look up pending effects through partial
-- indexes on "dispatched_at IS NULL". Statistics taken while nothing was pending (the usual state:
-- dispatched effects are deleted) say that no row matches, so that every such index looks empty
-- and interchangeable, and the planner would scan all pending effects for each ordering key once
-- a backlog builds up (measured: 5 s instead of 20 ms for one relay round of 500 effects after a
-- 30,000-effect backlog). Without statistics the planner takes a fixed share of the rows as
-- pending and picks the index that matches each look-up.
ALTER TABLE "{{schema}}"."{{prefix}}effects" ALTER COLUMN dispatched_at SET STATISTICS 0;
