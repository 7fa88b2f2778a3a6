package console

import (
	"context"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/watermill-outbox/outbox"
	"github.com/watermill-outbox/outbox/drivers/postgres"
	"github.com/watermill-outbox/outbox/internal/pgtest"
	"github.com/watermill-outbox/outbox/tenant"
)

// TestMembersOfKeepsOneOpsPerOutbox: calls for the same member and Outbox share one Ops; a
// member added again with another Outbox gets a new one; the old one is closed once both calls
// that returned it have seen their ctx end, not before (a request in flight keeps using it), and
// a member removed is forgotten.
func TestMembersOfKeepsOneOpsPerOutbox(t *testing.T) {
	db := pgtest.DB(t)
	newOutbox := func(prefix string) *outbox.Outbox {
		ob, err := outbox.New(outbox.Config{DB: db, Driver: postgres.Driver{}, TablePrefix: prefix, Publisher: nopPublisher{}})
		if err != nil {
			t.Fatal(err)
		}
		return ob
	}
	set, err := tenant.New(tenant.Config{Metadata: "tenant", NackUnresolved: true})
	if err != nil {
		t.Fatal(err)
	}
	if err := set.Add("a", newOutbox("a_")); err != nil {
		t.Fatal(err)
	}
	s := &setMembers{set: set, held: map[string]*heldOps{}}
	ctx1, end1 := context.WithCancel(context.Background())
	ctx2, end2 := context.WithCancel(context.Background())
	ctx3, end3 := context.WithCancel(context.Background())
	defer end3()
	l1, err1 := s.members(ctx1)
	l2, err2 := s.members(ctx2)
	if err1 != nil || err2 != nil || len(l1) != 1 || len(l2) != 1 || l1[0].Ops != l2[0].Ops {
		t.Fatalf("two calls: %v %v %+v %+v, want member a's one Ops in both", err1, err2, l1, l2)
	}
	old := s.held["a"]

	if err := set.Remove(context.Background(), "a"); err != nil {
		t.Fatal(err)
	}
	if err := set.Add("a", newOutbox("a2_")); err != nil {
		t.Fatal(err)
	}
	l3, err := s.members(ctx3)
	if err != nil || len(l3) != 1 || l3[0].Ops == l1[0].Ops {
		t.Fatalf("after a was added again with another Outbox: %v %+v, want a new Ops", err, l3)
	}
	end1()
	time.Sleep(50 * time.Millisecond) // the release runs on a goroutine of its own
	if old.closed.Load() {
		t.Fatal("the old Ops was closed while a call that returned it had not ended")
	}
	end2()
	deadline := time.Now().Add(5 * time.Second)
	for !old.closed.Load() {
		if time.Now().After(deadline) {
			t.Fatal("the old Ops is not closed after the calls that returned it ended")
		}
		time.Sleep(5 * time.Millisecond)
	}
	if s.held["a"].closed.Load() {
		t.Error("the new Ops was closed")
	}

	if err := set.Remove(context.Background(), "a"); err != nil {
		t.Fatal(err)
	}
	if l, err := s.members(ctx3); err != nil || len(l) != 0 || len(s.held) != 0 {
		t.Errorf("after a was removed: %v %+v, %d held; want no member and none held", err, l, len(s.held))
	}
}

type nopPublisher struct{}

func (nopPublisher) Publish(string, ...*message.Message) error { return nil }
func (nopPublisher) Close() error                              { return nil }
