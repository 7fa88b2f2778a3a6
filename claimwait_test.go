package outbox_test

import (
	"context"
	"database/sql"
	"errors"
	"net/url"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"

	"github.com/watermill-outbox/outbox"
)

// Item: a copy that waits in the claim (pessimistic) for another copy being handled is not a
// database that stalls: the gate neither probes nor holds the Outbox's other units meanwhile,
// whether the copy's unit took a pooled connection or opened one.
func TestClaimWaitIsNotTakenForAStall(t *testing.T) {
	for _, tc := range []struct {
		name string
		idle int
	}{{"pooled connection", 2}, {"new connection", 0}} {
		t.Run(tc.name, func(t *testing.T) {
			e := newEnv(t)
			e.db.SetMaxIdleConns(tc.idle)
			stop := outbox.WatchGate(e.ob)
			msg := message.NewMessage(uuid.NewString(), nil)
			entered := make(chan struct{})
			var once sync.Once
			slow := func(m *message.Message) ([]*message.Message, error) {
				once.Do(func() { close(entered) })
				time.Sleep(1500 * time.Millisecond)
				return applyAndPublish(nil)(m)
			}
			first := make(chan error, 1)
			go func() { first <- handle(e.ob, copyOf(msg), slow) }()
			<-entered // the first copy holds the claim
			began := time.Now()
			err := handle(e.ob, copyOf(msg), applyAndPublish(nil))
			waited := time.Since(began)
			if ferr := <-first; ferr != nil {
				t.Fatalf("the first copy: %v", ferr)
			}
			probes, held := stop()
			t.Logf("the copy waited %s (%v)", waited.Round(time.Millisecond), err)
			if waited < time.Second {
				t.Fatalf("the copy waited %s for the first one's claim; want about 1.5s", waited)
			}
			if probes != 0 || held {
				t.Fatalf("a claim that waited for a copy's: the gate probed %d times, held the Outbox's work: %v; want neither", probes, held)
			}
		})
	}
}

// Item: Health opens no connection while the gate suspects a stall: it waits for the probe under
// way, within its own bound, and reports what the probe found. Its ping, on a driver that ignores
// the context while it connects (lib/pq), would hang past the check's bound, one more connection
// to a server that answers none.
func TestHealthWaitsForTheProbeOfASuspectedStall(t *testing.T) {
	e := newEnv(t)
	u, err := url.Parse(e.dsn)
	if err != nil || u.Host == "" {
		t.Skipf("the test DSN is not a URL with a host (%v): the proxy needs one", err)
	}
	proxy := startDBProxy(t, u.Host)
	u.Host = proxy.Addr()
	pdb, err := sql.Open("postgres", u.String())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = pdb.Close() })
	pdb.SetMaxIdleConns(0) // a ping would open a connection
	ob := e.newOutbox(func(c *outbox.Config) { c.DB = pdb })
	proxy.SetHang(true)
	proxy.SetDown(true)
	t.Cleanup(func() { proxy.SetHang(false); proxy.SetDown(false) })
	release := make(chan struct{})
	outbox.SuspectStall(ob, func(context.Context) error {
		<-release
		return errors.New("no answer (test probe)")
	})
	time.AfterFunc(300*time.Millisecond, func() { close(release) })
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	done := make(chan outbox.HealthReport, 1)
	go func() { done <- ob.Health(ctx) }()
	select {
	case r := <-done:
		if n := proxy.Attempts(); n != 0 {
			t.Fatalf("Health during a suspected stall opened %d connections; want none", n)
		}
		if checkOK(r, outbox.CheckDatabase) {
			t.Fatalf("Health after the probe failed: %+v; want the database check failed", r)
		}
		t.Logf("Health: %+v", r.Checks[0])
	case <-time.After(4 * time.Second):
		t.Fatalf("Health during a suspected stall has not returned after 4s (its context: 1s); %d connections opened", proxy.Attempts())
	}
}
