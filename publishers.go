package outbox

import (
	"fmt"
	"reflect"
	"strings"

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
	case strings.HasPrefix(pkg, "github.com/ThreeDotsLabs/watermill-kafka") && name == "Publisher":
		// Sarama's RequiredAcks: 0 NoResponse, 1 WaitForLocal (its default), -1 WaitForAll.
		acks, ok := intField(v, "config", "OverwriteSaramaConfig", "Producer", "RequiredAcks")
		switch {
		case ok && acks == 0:
			return "the watermill-kafka Publisher's Sarama config has Producer.RequiredAcks = NoResponse: Publish " +
				"returns without waiting for the broker, which may never have the message " +
				"(set RequiredAcks = sarama.WaitForAll; see docs/brokers.md)"
		case ok && acks != -1:
			return "the watermill-kafka Publisher's Sarama config has Producer.RequiredAcks = WaitForLocal (Sarama's " +
				"default): Publish returns once the partition leader has the message, and a leader that fails before " +
				"its followers copied it loses messages the outbox marked sent (set RequiredAcks = sarama.WaitForAll " +
				"and min.insync.replicas >= 2; see docs/brokers.md)"
		}
	case pkg == "github.com/ThreeDotsLabs/watermill/pubsub/gochannel" && name == "GoChannel":
		return "GoChannel keeps messages in the process's memory: a crash loses every message not yet consumed " +
			"(fine for tests and demos, not for production)"
	}
	return ""
}

// boolField reads the bool at the path of (possibly unexported) fields of struct v.
func boolField(v reflect.Value, path ...string) (value, ok bool) {
	if v, ok = field(v, path...); !ok || v.Kind() != reflect.Bool {
		return false, false
	}
	return v.Bool(), true
}

// intField reads the signed integer (of any named int type) at the path of fields of struct v.
func intField(v reflect.Value, path ...string) (value int64, ok bool) {
	if v, ok = field(v, path...); !ok {
		return 0, false
	}
	switch v.Kind() {
	case reflect.Int, reflect.Int8, reflect.Int16, reflect.Int32, reflect.Int64:
		return v.Int(), true
	}
	return 0, false
}

// field follows the path of (possibly unexported) fields of struct v, through pointers.
func field(v reflect.Value, path ...string) (reflect.Value, bool) {
	for _, name := range path {
		if v.Kind() == reflect.Pointer {
			if v.IsNil() {
				return reflect.Value{}, false
			}
			v = v.Elem()
		}
		if v.Kind() != reflect.Struct {
			return reflect.Value{}, false
		}
		if v = v.FieldByName(name); !v.IsValid() {
			return reflect.Value{}, false
		}
	}
	return v, true
}

// warnUnsafePublisher logs, once when the Outbox is made, why its Publisher can lose messages.
func (o *Outbox) warnUnsafePublisher() {
	if reason := unsafePublisher(o.pub); reason != "" {
		o.logger.Error("The Publisher can lose side effects the outbox marks dispatched",
			fmt.Errorf("%w: %s", ErrUnsafePublisher, reason), nil)
	}
}
