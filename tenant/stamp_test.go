package tenant_test

import (
	"context"
	"database/sql"
	"testing"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"

	"github.com/watermill-outbox/outbox"
	"github.com/watermill-outbox/outbox/internal/pgtest"
	"github.com/watermill-outbox/outbox/middleware"
	"github.com/watermill-outbox/outbox/outboxtest"
	"github.com/watermill-outbox/outbox/tenant"
)

// With Config.Metadata, the Set resolves by that key and stamps it on what a member's units of
// work publish, so that the events of a tenant's handler come back to the same tenant; a message
// naming the Unresolved member is refused like one that names no member. Without it (a
// FromMetadata Resolver) the events go without the key, and their consumer refuses them.
func TestSetMetadataFollowsTheEvents(t *testing.T) {
	db := pgtest.DB(t)
	rec := &outboxtest.Recorder{}
	unrouted := newMember(t, db, "u_", rec)
	set, err := tenant.New(tenant.Config{Metadata: "tenant", Unresolved: "unrouted"})
	if err != nil {
		t.Fatal(err)
	}
	for name, ob := range map[string]*outbox.Outbox{"a": newMember(t, db, "a_", rec), "b": newMember(t, db, "b_", rec), "unrouted": unrouted} {
		if err := set.Add(name, ob); err != nil {
			t.Fatal(err)
		}
	}
	sh := newShop(func(tn string) string { return tn + "_orders" })
	orders := set.WrapConsumer(sh.handle, middleware.WithConsumer("shop"))
	// A second consumer of the events, through the same Set: it stores each where it resolves.
	audit := set.WrapConsumer(func(msg *message.Message) error {
		_, err := outbox.Tx(msg.Context()).ExecContext(msg.Context(), `INSERT INTO `+msg.Metadata.Get("tenant")+`_orders VALUES ($1, 'audit')`, msg.UUID)
		return err
	}, middleware.WithConsumer("audit"))

	if err := orders(tenantMsg("a-1", "a")); err != nil {
		t.Fatal(err)
	}
	if err := set.InTx(context.Background(), "b", func(ctx context.Context, _ *sql.Tx) error {
		own := message.NewMessage("b-own", nil)
		own.Metadata.Set("tenant", "a") // set by the message itself: kept
		if err := outbox.Publish(ctx, "events", own); err != nil {
			return err
		}
		return outbox.Publish(ctx, "events", message.NewMessage("b-api", nil))
	}); err != nil {
		t.Fatal(err)
	}
	want := map[string]string{"event-a-1": "a", "b-own": "a", "b-api": "b"}
	for _, s := range rec.All() {
		if tn, ok := want[s.Message.UUID]; ok {
			if got := s.Message.Metadata.Get("tenant"); got != tn {
				t.Errorf("%s went out with tenant %q, want %q", s.Message.UUID, got, tn)
			}
			if err := audit(s.Message.Copy()); err != nil {
				t.Errorf("the audit of %s: %v", s.Message.UUID, err)
			}
			delete(want, s.Message.UUID)
		}
	}
	if len(want) > 0 {
		t.Fatalf("not sent: %v", want)
	}
	if got := rows(t, db, "a_orders"); len(got["event-a-1"]) != 1 || len(got["b-own"]) != 1 {
		t.Errorf("a's orders: %v, want its order's event and b-own audited there", got)
	}
	if got := rows(t, db, "b_orders"); len(got["b-api"]) != 1 {
		t.Errorf("b's orders: %v, want b-api audited there", got)
	}

	// A message naming the Unresolved member is no tenant's: refused, its dead letter kept there.
	if err := orders(tenantMsg("u-1", "unrouted")); err != nil {
		t.Fatal(err)
	}
	if sh.runsOf("u-1") != 0 {
		t.Error("the handler ran for a message naming the Unresolved member")
	}
	dls, err := unrouted.DeadLetters(context.Background(), outbox.DeadLetterFilter{})
	if err != nil || len(dls) != 1 || dls[0].MessageID != "u-1" {
		t.Fatalf("the Unresolved member's dead letters: %v, %v; want u-1's", dls, err)
	}

	// Without Metadata the events carry no tenant.
	plain := newSet(t, tenant.Config{}, map[string]*outbox.Outbox{"c": newMember(t, db, "c_", rec)})
	if err := plain.WrapConsumer(newShop(func(string) string { return "c_orders" }).handle, middleware.WithConsumer("shop"))(tenantMsg("c-1", "c")); err != nil {
		t.Fatal(err)
	}
	for _, s := range rec.All() {
		if s.Message.UUID == "event-c-1" && s.Message.Metadata.Get("tenant") != "" {
			t.Errorf("event-c-1 carries tenant %q without Config.Metadata", s.Message.Metadata.Get("tenant"))
		}
	}
}

// The messages a handler returns (the message.HandlerFunc form, through Wrap or the Set's
// Middleware on a Router handler) are stored as the member's effects to the handler's publish
// topic, and carry the member's name under Config.Metadata like those of outbox.Publish; one
// that sets the key itself keeps its own.
func TestSetMetadataOnReturnedMessages(t *testing.T) {
	db := pgtest.DB(t)
	rec := &outboxtest.Recorder{}
	set := newSet(t, tenant.Config{Metadata: "tenant"}, map[string]*outbox.Outbox{
		"a": newMember(t, db, "a_", rec), "b": newMember(t, db, "b_", rec)})
	reply := func(tag string) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			own := message.NewMessage(tag+"-own-"+msg.UUID, nil)
			own.Metadata.Set("tenant", "elsewhere")
			return []*message.Message{message.NewMessage(tag+"-"+msg.UUID, nil), own}, nil
		}
	}
	in := gochannel.NewGoChannel(gochannel.Config{OutputChannelBuffer: 16}, watermill.NopLogger{})
	router, err := message.NewRouter(message.RouterConfig{}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	router.AddHandler("wrapped", "orders", in, "replies", in, set.Wrap(reply("wrap")))
	router.AddHandler("middleware", "orders", in, "replies", in, reply("mw")).AddMiddleware(set.Middleware())
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); _ = router.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		<-done
		_ = in.Close()
	})
	<-router.Running()
	if err := in.Publish("orders", tenantMsg("a-1", "a"), tenantMsg("b-1", "b")); err != nil {
		t.Fatal(err)
	}
	want := map[string]string{}
	for _, tag := range []string{"wrap", "mw"} {
		for _, tn := range []string{"a", "b"} {
			want[tag+"-"+tn+"-1"] = tn
			want[tag+"-own-"+tn+"-1"] = "elsewhere"
		}
	}
	got := map[string]string{}
	eventually(t, "every returned message went out", func() bool {
		for _, s := range rec.All() {
			if s.Topic == "replies" {
				got[s.Message.UUID] = s.Message.Metadata.Get("tenant")
			}
		}
		return len(got) >= len(want)
	})
	for uuid, tn := range want {
		if got[uuid] != tn {
			t.Errorf("%s went out with tenant %q, want %q", uuid, got[uuid], tn)
		}
	}
	// Each in its member's tables: a's replies are a's effects, not b's.
	for _, tn := range []string{"a", "b"} {
		var n int
		if err := db.QueryRow(`SELECT count(*) FROM `+tn+`_processed WHERE message_id = $1`, tn+"-1").Scan(&n); err != nil {
			t.Fatal(err)
		}
		if n != 2 {
			t.Errorf("%s's claims of %s-1: %d, want one per handler", tn, tn, n)
		}
	}
}
