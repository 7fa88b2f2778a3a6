package mysql

import "github.com/watermill-outbox/outbox/store"

// SetLockingDueRead turns the insert's look at due delayed effects (insertEffects) on or off,
// for the benchmark that weighs it.
func SetLockingDueRead(on bool) { lockingDueRead.Store(on) }

// MigrationLockName is the GET_LOCK name of the migrations of the tables of schema and prefix, as
// a process configured so takes it.
func MigrationLockName(schema, prefix string) string {
	return lockName(store.Names{Schema: schema, Prefix: prefix})
}
