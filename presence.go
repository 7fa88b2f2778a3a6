package outbox

import (
	"context"
	"runtime"
	"weak"

	"go.opentelemetry.io/otel/metric"
)

// reportPresence reports outbox.relay.running for o from now on: 1 while a background life runs
// its relay, 0 while none does. The OutboxRelayStalled alert reads it to find an Outbox that
// nothing runs (a process that never calls Run); it read the counters before, which stay exported
// under every name an Outbox had (the one it was created with, before a tenant.Set named it, and
// a member's after its removal), and so it fired for every Set and every removed member.
//
// It stops when o is closed or retired (removed from its Set), until it runs again, and when the
// service drops o: the callback holds o weakly, and is unregistered once o is collected.
func (o *Outbox) reportPresence() {
	w := weak.Make(o)
	g, tables := o.tel.relayRunning, o.tel.tablesName
	reg, err := o.tel.meter.RegisterCallback(func(_ context.Context, obs metric.Observer) error {
		o := w.Value()
		if o == nil {
			return nil
		}
		running := o.relaysRunning.Load() > 0
		if !running && o.retired.Load() {
			return nil
		}
		v := int64(0)
		if running {
			v = 1
		}
		obs.ObserveInt64(g, v, o.tel.attrs(AttrTables, tables, "", ""))
		return nil
	}, g)
	if err != nil {
		o.logger.Error("Registering the outbox.relay.running gauge failed; it is not reported", err, nil)
		return
	}
	runtime.AddCleanup(o, func(r metric.Registration) { _ = r.Unregister() }, reg)
}
