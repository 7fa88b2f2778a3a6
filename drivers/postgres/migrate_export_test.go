package postgres

import "github.com/watermill-outbox/outbox/store"

// MigrationLockForTest is the statement that takes the migration lock of the tables prefix in
// schema.
func MigrationLockForTest(schema, prefix string) string {
	n, err := store.NewNames(schema, prefix)
	if err != nil {
		panic(err)
	}
	return migrateQueries(n).Lock
}
