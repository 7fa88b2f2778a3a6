package outbox

import (
	"reflect"
	"strings"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
)

// unsafePublisher tells, for the Publishers of Watermill's pub/subs whose settings it can read,
// why Publish may return before the broker has the message, so that an effect the outbox marks
// dispatched can still be lost: "" when it is safe or unknown. It reads their settings by
// reflection, not to depend on every pub/sub; a Publisher that wraps another is not looked into.
func unsafePublisher(p message.Publisher) string {
	v := reflect.ValueOf(p)
	if v.Kind() == reflect.Pointer && !v.IsNil() {
		v = v.Elem()
	}
	if v.Kind() != reflect.Struct {
		return ""
	}
	pkg, name := v.Type().PkgPath(), v.Type().Name()
	switch {
	case strings.HasPrefix(pkg, "github.com/ThreeDotsLabs/watermill-amqp") && name == "Publisher":
		transactional, ok1 := boolField(v, "config", "Publish", "Transactional")
		confirm, ok2 := boolField(v, "config", "Publish", "ConfirmDelivery")
		if ok1 && !transactional && (!ok2 || !confirm) {
			return "the watermill-amqp Publisher publishes without publisher confirms or transactions: Publish returns " +
				"once the frame is written, and a broker crash loses messages the outbox marked sent " +
				"(set Publish.ConfirmDelivery or Publish.Transactional; see docs/brokers.md)"
		}
	case strings.HasPrefix(pkg, "github.com/ThreeDotsLabs/watermill-nats") && name == "Publisher":
		if disabled, ok := boolField(v, "config", "JetStream", "Disabled"); ok && disabled {
			return "the watermill-nats Publisher publishes with core NATS (JetStream disabled): there is no " +
				"acknowledgement, and a message nobody is subscribed to at that moment is lost (enable JetStream; see docs/brokers.md)"
		}
	case pkg == "github.com/ThreeDotsLabs/watermill/pubsub/gochannel" && name == "GoChannel":
		return "GoChannel keeps messages in the process's memory: a crash loses every message not yet consumed " +
			"(fine for tests and demos, not for production)"
	}
	return ""
}

// boolField reads the bool at the path of (possibly unexported) fields of struct v.
func boolField(v reflect.Value, path ...string) (value, ok bool) {
	for _, name := range path {
		if v.Kind() == reflect.Pointer {
			if v.IsNil() {
				return false, false
			}
			v = v.Elem()
		}
		if v.Kind() != reflect.Struct {
			return false, false
		}
		if v = v.FieldByName(name); !v.IsValid() {
			return false, false
		}
	}
	if v.Kind() != reflect.Bool {
		return false, false
	}
	return v.Bool(), true
}

// warnUnsafePublisher logs, once when the Outbox is made, why its Publisher can lose messages.
func (o *Outbox) warnUnsafePublisher() {
	if reason := unsafePublisher(o.pub); reason != "" {
		o.logger.Error("The Publisher can lose side effects the outbox marks dispatched", ErrUnsafePublisher,
			watermill.LogFields{"reason": reason})
	}
}
