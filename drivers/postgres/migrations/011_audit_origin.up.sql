-- Who made a change, beyond the name the caller gives (which anyone may write): the database role
-- and the address of its connection, set by the database in a trigger so that a writer cannot
-- set them (current_user is the role that inserts: the function is not SECURITY DEFINER), and
-- the address of the HTTP client that asked for it, which the console writes (empty otherwise).
ALTER TABLE "{{schema}}"."{{prefix}}audit" ADD COLUMN IF NOT EXISTS db_role text;
ALTER TABLE "{{schema}}"."{{prefix}}audit" ADD COLUMN IF NOT EXISTS client_addr inet;
ALTER TABLE "{{schema}}"."{{prefix}}audit" ADD COLUMN IF NOT EXISTS remote_addr text NOT NULL DEFAULT '';
CREATE OR REPLACE FUNCTION "{{schema}}"."{{prefix}}audit_origin"() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    NEW.db_role := current_user;
    NEW.client_addr := inet_client_addr();
    RETURN NEW;
END
$$;
DROP TRIGGER IF EXISTS "{{prefix}}audit_origin" ON "{{schema}}"."{{prefix}}audit";
CREATE TRIGGER "{{prefix}}audit_origin" BEFORE INSERT OR UPDATE ON "{{schema}}"."{{prefix}}audit"
    FOR EACH ROW EXECUTE FUNCTION "{{schema}}"."{{prefix}}audit_origin"();

-- The console lists the newest poisoned messages: poisoned claims are few among the retained
-- ones, and this index finds them without reading every claim.
CREATE INDEX IF NOT EXISTS "{{prefix}}processed_poisoned"
    ON "{{schema}}"."{{prefix}}processed" (processed_at) WHERE poisoned;
