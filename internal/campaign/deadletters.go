package campaign

import (
	"context"
	"database/sql"
	"errors"
	"sync"
	"sync/atomic"
	"time"

	"github.com/watermill-outbox/outbox"
)

// retryDeadLetters fixes the poison messages drawn for a retry and retries their dead letters
// from two instances at once (one of them must retry it), waits for the relays to send each back
// to the topic it came from, and delivers it from there, as the broker would, until one copy is
// acked. It runs while the draining relays run.
func (c *run) retryDeadLetters(specs []*spec, acked []atomic.Bool) {
	var wg sync.WaitGroup
	for i, sp := range specs {
		if !sp.poison {
			continue
		}
		if acked[i].Load() {
			c.stats.reached("dead-lettered")
		}
		if !sp.retry || !acked[i].Load() {
			continue
		}
		sp.broken.Store(false)
		a, b := c.r.IntN(instances), c.r.IntN(instances)
		procs := c.r.Perm(instances)[:2]
		wg.Add(1)
		go func() {
			defer wg.Done()
			var retried atomic.Int32
			var both sync.WaitGroup
			for _, proc := range procs {
				both.Add(1)
				go func() {
					defer both.Done()
					n, err := c.members[proc][sp.tenant].RetryDeadLetters(context.Background(), "campaign", outbox.Source{Consumer: consumer, ID: sp.id})
					if err != nil {
						c.fail("retry of the dead letter of %s on instance %d: %v", sp.id, proc, err)
					}
					retried.Add(int32(n))
				}()
			}
			both.Wait()
			if n := retried.Load(); n != 1 {
				c.fail("the dead letter of %s was retried %d times by two instances at once, want once", sp.id, n)
				return
			}
			c.stats.reached("dead letter retried")
			c.note("%s: dead letter retried", sp.id[:8])
			deadline := time.Now().Add(drainFor)
			for !c.onTopic(c.inTopic, sp.id) {
				if time.Now().After(deadline) {
					c.fail("the retried dead letter of %s never reached %s", sp.id, c.inTopic)
					return
				}
				time.Sleep(20 * time.Millisecond)
			}
			// The broker delivers it to an instance, and a second copy to another.
			for _, proc := range []int{a, b} {
				began := time.Now()
				for try := 0; ; try++ {
					err := c.deliver(proc, &plan{msg: sp})
					if err == nil {
						break
					}
					if givesUp(try, began) {
						c.fail("retried dead letter %s, delivered to instance %d: %v", sp.id, proc, err)
						return
					}
					redeliveryPause(try)
				}
			}
		}()
	}
	wg.Wait()
}

// onTopic tells whether a message with id reached topic.
func (c *run) onTopic(topic, id string) bool {
	var n int
	if err := c.db.QueryRow(c.database.Bind(`SELECT count(*) FROM (`+c.database.Wire(topic)+`) w WHERE w.uuid = $1`), id).Scan(&n); err != nil {
		c.fail("read %s: %v", topic, err)
		return false
	}
	return n > 0
}

// checkDeadLetters checks the dead letters table: a poison message that was acked has a dead
// letter with its payload and source topic (retried when it was retried, dead otherwise), and no
// other message has one.
func (c *run) checkDeadLetters(specs []*spec, acked []atomic.Bool) {
	for i, sp := range specs {
		var state, topic string
		var payload []byte
		err := c.dbs[sp.tenant].QueryRow(c.database.Bind(`SELECT state, source_topic, payload FROM `+c.prefix+`dead_letters WHERE consumer = $1 AND message_id = $2`),
			consumer, sp.id).Scan(&state, &topic, &payload)
		found := err == nil
		if err != nil && !isNoRows(err) {
			c.fail("read the dead letter of %s: %v", sp.id, err)
			continue
		}
		switch {
		case !sp.poison && found:
			c.fail("message %s, which never failed permanently, was dead-lettered (%s)", sp.id, state)
		case sp.poison && acked[i].Load() && !found:
			c.fail("poison message %s was acked without a dead letter", sp.id)
		case !found:
		case topic != c.inTopic || string(payload) != sp.id+"/in":
			c.fail("dead letter of %s stored with topic %q and payload %q", sp.id, topic, payload)
		case sp.retry && state != "retried":
			c.fail("retried dead letter of %s is %s", sp.id, state)
		case !sp.retry && state != "dead":
			c.fail("dead letter of %s, never retried, is %s", sp.id, state)
		}
	}
}

func isNoRows(err error) bool { return errors.Is(err, sql.ErrNoRows) }
