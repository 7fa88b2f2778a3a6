package nats_test

import (
	"testing"

	"github.com/ThreeDotsLabs/watermill"
	wnats "github.com/ThreeDotsLabs/watermill-nats/v2/pkg/nats"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"

	"github.com/watermill-outbox/outbox"
	"github.com/watermill-outbox/outbox/drivers/postgres"
	"github.com/watermill-outbox/outbox/e2e/internal/natstest"
	"github.com/watermill-outbox/outbox/internal/logtest"
	"github.com/watermill-outbox/outbox/internal/pgtest"
)

// TestUnsafePublishersAreReported: New says so, once, when it recognises a Publisher that may
// return before the broker has the message; it says nothing of the others.
func TestUnsafePublishersAreReported(t *testing.T) {
	db := pgtest.DB(t)
	ns := natstest.Start(t)
	core, err := wnats.NewPublisherWithNatsConn(natstest.Conn(t, ns, "core"), wnats.PublisherPublishConfig{
		Marshaler: &wnats.NATSMarshaler{}, SubjectCalculator: wnats.DefaultSubjectCalculator, JetStream: wnats.JetStreamConfig{Disabled: true}}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	js, err := wnats.NewPublisherWithNatsConn(natstest.Conn(t, ns, "js"), wnats.PublisherPublishConfig{
		Marshaler: &wnats.NATSMarshaler{}, SubjectCalculator: wnats.DefaultSubjectCalculator, JetStream: wnats.JetStreamConfig{AutoProvision: true}}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	goChannel := gochannel.NewGoChannel(gochannel.Config{}, watermill.NopLogger{})
	defer goChannel.Close()
	for _, c := range []struct {
		name   string
		pub    message.Publisher
		unsafe bool
	}{
		{"core NATS", core, true},
		{"GoChannel", goChannel, true},
		{"NATS JetStream", js, false},
		{"a wrapping Publisher", publisherFunc(core.Publish), false},
	} {
		logs := &logtest.Errors{}
		if _, err := outbox.New(outbox.Config{DB: db, Driver: postgres.Driver{}, Publisher: c.pub, Logger: logs}); err != nil {
			t.Fatal(err)
		}
		if got := logs.Contains(outbox.ErrUnsafePublisher.Error()); got != c.unsafe {
			t.Errorf("%s: reported as unsafe: %v, want %v (logged: %v)", c.name, got, c.unsafe, logs.Lines())
		}
	}
}
