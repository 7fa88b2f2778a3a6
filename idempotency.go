package outbox

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"math/rand/v2"
	"strconv"
	"strings"
	"sync"
	"time"
	"unicode/utf8"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"

	"github.com/watermill-outbox/outbox/outboxdriver"
)

// keyed is the idempotency key of a context, and the outcome of the last unit of work that ran
// with it (read with IdempotencyResult).
type keyed struct {
	scope, key  string
	fingerprint []byte
	wait        bool

	mu       sync.Mutex
	done     bool
	replayed bool
	result   []byte
}

type keyedKey struct{}

// KeyOption is an option of WithIdempotencyKey.
type KeyOption func(*keyed)

// Fingerprint sets the fingerprint of the request the key comes with (a hash of what makes the
// request what it is: method, path, body). A key committed with another fingerprint makes InTx
// return ErrIdempotencyMismatch. Without it the fingerprint is empty, and only another empty
// fingerprint matches.
func Fingerprint(fp []byte) KeyOption {
	fp = append([]byte(nil), fp...)
	return func(k *keyed) { k.fingerprint = fp }
}

// WaitInFlight makes InTx wait, while another unit of work holds the key uncommitted, for its
// outcome (within HandlerTimeout and ctx) and then replay its result, or run if it rolled back,
// instead of returning ErrIdempotencyInFlight at once.
func WaitInFlight() KeyOption { return func(k *keyed) { k.wait = true } }

// WithIdempotencyKey returns a context that makes InTx (and InUnit) a keyed unit of work: key,
// unique within scope, is claimed in the transaction of fn,
// so that it commits with the business change, the side effects and the result fn sets with
// SetResult. A call with a key committed before (and not expired, see
// Config.IdempotencyRetention) runs nothing, sends nothing and returns nil; IdempotencyResult then
// returns the stored result. While another call holds the key uncommitted, InTx returns
// ErrIdempotencyInFlight (or waits, with WaitInFlight); for a key committed with another
// Fingerprint it returns ErrIdempotencyMismatch. A key is not stored when fn fails: a retry runs
// again. Keys come from clients: make the scope name the client who sent the key
// (CallerScope(caller, "orders")), or two clients who pick the same key meet on it.
func WithIdempotencyKey(ctx context.Context, scope, key string, opts ...KeyOption) context.Context {
	k := &keyed{scope: scope, key: key}
	for _, opt := range opts {
		opt(k)
	}
	return context.WithValue(ctx, keyedKey{}, k)
}

// CallerScope returns the scope of the keys of caller (the authenticated principal, the API
// client) within scope (an API, an endpoint; it may be empty), for WithIdempotencyKey: a key
// belongs to its caller, or another caller who sends the same key gets the first caller's stored
// result. Each (caller, scope) pair gets a scope of its own, distinct from every other pair's (the
// caller's length comes first, so no caller's name can reach into another's scope), and a valid
// one: a pair longer than 255 bytes, or with bytes a scope cannot hold, is hashed (SHA-256).
// An empty caller (a request nobody authenticated) has no scope: a unit of work keyed in what
// CallerScope returns for it fails with ErrInvalidIdempotencyKey, rather than putting every
// anonymous caller's keys in one scope, where one would get another's stored result.
func CallerScope(caller, scope string) string {
	if caller == "" {
		return noCaller
	}
	s := strconv.Itoa(len(caller)) + ":" + caller + ":" + scope
	if len(s) <= 255 && utf8.ValidString(s) && !strings.ContainsRune(s, 0) {
		return s
	}
	h := sha256.Sum256([]byte(s))
	return "sha256:" + hex.EncodeToString(h[:])
}

func keyedFrom(ctx context.Context) *keyed {
	k, _ := ctx.Value(keyedKey{}).(*keyed)
	return k
}

// SetResult sets the result of the keyed unit of work of ctx (the response of the request):
// it is stored with the key when the unit commits, and returned by IdempotencyResult to this call
// and to every retry with the key. The last call wins. It returns an error outside a keyed unit
// of work, or for a result larger than Config.MaxPayloadBytes.
func SetResult(ctx context.Context, result []byte) error {
	u := unitFrom(ctx)
	if u == nil {
		return ErrNoUnitOfWork
	}
	if u.key == nil {
		return fmt.Errorf("outbox: SetResult in a unit of work without an idempotency key (see WithIdempotencyKey): %w", ErrNoUnitOfWork)
	}
	if len(result) > u.o.cfg.MaxPayloadBytes {
		return fmt.Errorf("%w: result of %d bytes for idempotency key %q, the limit is %d (Config.MaxPayloadBytes)",
			ErrPayloadTooLarge, len(result), u.key.key, u.o.cfg.MaxPayloadBytes)
	}
	u.mu.Lock()
	defer u.mu.Unlock()
	if u.finished {
		return ErrUnitOfWorkFinished
	}
	u.result = append([]byte(nil), result...)
	return nil
}

// IdempotencyResult returns the result of the last keyed unit of work that ran with ctx (the
// context returned by WithIdempotencyKey, or one derived from it): what fn set with SetResult
// when it ran and committed, or the stored result when the key was committed before (replayed
// true). Before InTx returned nil it returns nil and false.
func IdempotencyResult(ctx context.Context) (result []byte, replayed bool) {
	k := keyedFrom(ctx)
	if k == nil {
		return nil, false
	}
	k.mu.Lock()
	defer k.mu.Unlock()
	if !k.done {
		return nil, false
	}
	return append([]byte(nil), k.result...), k.replayed
}

// outcome records the outcome of a unit of work that committed (or found the key committed).
func (k *keyed) outcome(result []byte, replayed bool) {
	k.mu.Lock()
	defer k.mu.Unlock()
	k.done, k.replayed, k.result = true, replayed, result
}

func (k *keyed) reset() {
	k.mu.Lock()
	defer k.mu.Unlock()
	k.done, k.replayed, k.result = false, false, nil
}

// noCaller is what CallerScope returns for an empty caller: a scope validate refuses (a NUL
// byte), with an error of its own.
const noCaller = "\x00no caller"

func (k *keyed) validate() error {
	if k.scope == noCaller {
		return fmt.Errorf("%w: scope: CallerScope of an empty caller (an unauthenticated request): "+
			"the keys of every such caller would be one caller's; refuse the key, or name the caller", ErrInvalidIdempotencyKey)
	}
	if k.scope != "" {
		if err := validateName(k.scope); err != nil {
			return fmt.Errorf("%w: scope: %w", ErrInvalidIdempotencyKey, err)
		}
	}
	if err := validateName(k.key); err != nil {
		return fmt.Errorf("%w: key: %w", ErrInvalidIdempotencyKey, err)
	}
	return nil
}

// claimKey claims the key of a keyed unit of work in tx. It returns true when the unit is to
// run; false when the key was committed before (its result is then recorded as replayed).
func (o *Outbox) claimKey(ctx context.Context, tx outboxdriver.UnitTx, k *keyed) (bool, error) {
	kt, ok := tx.(outboxdriver.KeyedUnitTx)
	if !ok {
		return false, fmt.Errorf("outbox: %w: its units of work run on %T", ErrIdempotencyUnsupported, tx.Tx())
	}
	// Never waits in the store: a unit that waits for another (WaitInFlight) does so without a
	// connection (InUnit, waitKey).
	c, err := kt.KeyClaim(ctx, outboxdriver.KeyClaimParams{Scope: k.scope, Key: k.key, Fingerprint: k.fingerprint,
		Retention: o.cfg.IdempotencyRetention})
	switch {
	case errors.Is(err, ErrIdempotencyInFlight):
		return false, err // its text names the framework, the scope and the key already
	case err != nil:
		return false, fmt.Errorf("outbox: claim idempotency key %q (scope %q): %w", k.key, k.scope, err)
	case c.Claimed:
		return true, nil
	case string(c.Fingerprint) != string(k.fingerprint):
		return false, fmt.Errorf("%w: key %q (scope %q) was used for another request", ErrIdempotencyMismatch, k.key, k.scope)
	}
	k.outcome(c.Result, true)
	return false, nil
}

// Retries that wait for a key held by another unit of work look again after keyPollFirst, then
// after twice as long each time up to keyPollMax, or at once when the unit that held it in this
// process ended. Each look is a short transaction (BEGIN, the key's try-lock, ROLLBACK), so a
// waiter costs at most about a dozen statements a second and no connection between them.
const (
	keyPollFirst = 10 * time.Millisecond
	keyPollMax   = 250 * time.Millisecond
)

// waitKey waits before a retry looks at key again: d, or until a unit of this process that held
// the key ends, or ctx (the caller) or txCtx (HandlerTimeout) ends.
func (o *Outbox) waitKey(ctx, txCtx context.Context, k *keyed, d time.Duration) error {
	t := time.NewTimer(d/2 + rand.N(d/2+1)) // spread: retries of one key do not look in step
	defer t.Stop()
	select {
	case <-t.C:
		return nil
	case <-o.keysHeld.ended(k.scope, k.key):
		return nil
	case <-ctx.Done():
	case <-txCtx.Done():
	}
	return k.waitEnded(ctx, txCtx, o.cfg.HandlerTimeout, nil)
}

// waitEnded is the error of a retry whose wait for the unit holding its key ended, by the
// caller's context or by HandlerTimeout, between two looks at the key or during one (look: what
// that look returned); a look that failed for another reason is returned as it is.
func (k *keyed) waitEnded(ctx, txCtx context.Context, timeout time.Duration, look error) error {
	var err error
	switch {
	case ctx.Err() != nil:
		err = fmt.Errorf("outbox: waited for the unit of work in flight with idempotency key %q (scope %q) until the caller's context ended: %w",
			k.key, k.scope, ctx.Err())
	case txCtx.Err() != nil:
		err = fmt.Errorf("outbox: waited for the unit of work in flight with idempotency key %q (scope %q), at most HandlerTimeout (%s): %w",
			k.key, k.scope, timeout, ErrIdempotencyInFlight)
	default:
		return look
	}
	if look != nil {
		err = fmt.Errorf("%w (it ended during a look at the key: %w)", err, look)
	}
	return err
}

// heldKeys tells the units of this process that hold an idempotency key, so that the retries
// waiting for one look again as soon as it ends.
type heldKeys struct {
	mu   sync.Mutex
	held map[[2]string]chan struct{}
}

// hold records that a unit holds scope and key; the returned function, called when the unit has
// ended (committed or rolled back), wakes the retries waiting for it.
func (h *heldKeys) hold(scope, key string) (release func()) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.held == nil {
		h.held = map[[2]string]chan struct{}{}
	}
	k := [2]string{scope, key}
	ch := make(chan struct{})
	h.held[k] = ch
	return func() {
		h.mu.Lock()
		defer h.mu.Unlock()
		if h.held[k] == ch {
			delete(h.held, k)
		}
		close(ch)
	}
}

// ended returns a channel closed when the unit of this process that holds scope and key ends; nil
// (never ready) when none does.
func (h *heldKeys) ended(scope, key string) <-chan struct{} {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.held[[2]string{scope, key}]
}

// derivedNamespace is the namespace of the UUIDs NewUUID derives.
var derivedNamespace = uuid.MustParse("6f1b6a55-5f7e-4c1e-8b4a-0d9a7c3e2f10")

// newID returns a new random ID: a time-ordered UUID (version 7), so that the IDs of messages
// and units of work created one after another sort by their creation. A consumer deduplicates
// by message ID in a B-tree: time-ordered IDs land at its right edge, where random ones touch a
// page anywhere in it, each written whole to the WAL once after every checkpoint (2M retained
// IDs: 7.7 KB of WAL per message with random IDs against 0.8 KB with time-ordered ones).
func newID() string {
	u, err := uuid.NewV7()
	if err != nil {
		return uuid.NewString()
	}
	return u.String()
}

// NewUUID returns a UUID for an effect of the unit of work of ctx derived from the unit's cause
// and the effect's position among the UUIDs derived in the unit: the consumer and ID of the
// incoming message, or the scope, idempotency key and fingerprint of a keyed boundary unit (a
// name-based UUID, version 5). A run of the same cause again (a redelivery after a rolled-back attempt, a
// retry after a commit that was lost to a failover or a restore) that derives its UUIDs in the
// same order gets the same UUIDs, which downstream deduplication already knows. Outside a unit of
// work, and in a boundary unit without a key, whose cause is new on every call, the UUID is
// random and time-ordered (version 7). Record derives the UUIDs of its effects here, in the same
// sequence. See docs/boundary.md ("Effect UUIDs derived from their cause") for when this is safe.
func NewUUID(ctx context.Context) string {
	u := unitFrom(ctx)
	if u == nil {
		return newID()
	}
	var cause string
	switch {
	case u.incoming != nil:
		cause = "message\x00" + u.src.Consumer + "\x00" + u.src.ID
	case u.key != nil:
		cause = "key\x00" + u.key.scope + "\x00" + u.key.key
		if len(u.key.fingerprint) > 0 {
			// The request is part of the cause: a key reused for another request once it
			// expired derives other UUIDs, which downstream deduplication (whose memory outlasts
			// the key's) does not take for the first request's.
			cause += "\x00" + hex.EncodeToString(u.key.fingerprint)
		}
	default:
		return newID()
	}
	u.mu.Lock()
	n := u.derived
	u.derived++
	u.mu.Unlock()
	return uuid.NewSHA1(derivedNamespace, []byte(cause+"\x00"+strconv.Itoa(n))).String()
}

// NewMessage returns a message with payload whose UUID is derived from the cause of the unit of
// work of ctx and its position (NewUUID), to record with Publish.
func NewMessage(ctx context.Context, payload message.Payload) *message.Message {
	return message.NewMessage(NewUUID(ctx), payload)
}

// keyOutcome tells the telemetry outcome of a keyed unit's refusal.
func keyOutcome(err error) string {
	if errors.Is(err, ErrIdempotencyInFlight) || errors.Is(err, ErrIdempotencyMismatch) {
		return OutcomeKeyConflict
	}
	return OutcomeFailed
}
