package mysql

// SetLockingDueRead turns the insert's look at due delayed effects (insertEffects) on or off,
// for the benchmark that weighs it.
func SetLockingDueRead(on bool) { lockingDueRead.Store(on) }
