package outbox_test

import (
	"database/sql"
	"strings"
	"testing"

	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"

	"github.com/watermill-outbox/outbox"
	"github.com/watermill-outbox/outbox/drivers/postgres"
)

// Item: a Publisher variable that was never assigned is a typed nil inside the interface, which
// passed the nil check and failed only at the first dispatch, with a nil-pointer panic in the relay.
func TestNewRefusesATypedNilPublisher(t *testing.T) {
	db, err := sql.Open("postgres", "host=/nonexistent") // not connected: New must refuse first
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	var pub *gochannel.GoChannel // declared, never assigned
	ob, err := outbox.New(outbox.Config{DB: db, Driver: postgres.Driver{}, Publisher: pub})
	if err == nil {
		_ = ob.Close()
		t.Fatal("New accepted a nil *gochannel.GoChannel as the Publisher")
	}
	if !strings.Contains(err.Error(), "Publisher") || !strings.Contains(err.Error(), "*gochannel.GoChannel") {
		t.Errorf("the error should name the Publisher and its type: %v", err)
	}
}
