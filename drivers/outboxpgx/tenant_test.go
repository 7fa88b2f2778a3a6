package outboxpgx_test

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/watermill-outbox/outbox"
	"github.com/watermill-outbox/outbox/drivers/outboxpgx"
	"github.com/watermill-outbox/outbox/internal/pgtest"
	"github.com/watermill-outbox/outbox/internal/settest"
	"github.com/watermill-outbox/outbox/middleware"
	"github.com/watermill-outbox/outbox/outboxtest"
	"github.com/watermill-outbox/outbox/tenant"
)

// A tenant.Set of pgx Outboxes, a database each: interleaved messages of both tenants and their
// copies land once each in their tenant's database, in both modes, and Do runs a boundary unit of
// work of the pgx form on a member.
func TestTenantSetOfPgxMembers(t *testing.T) {
	for name, mode := range map[string]outboxpgx.Concurrency{"pessimistic": outboxpgx.Pessimistic, "optimistic": outboxpgx.Optimistic} {
		t.Run(name, func(t *testing.T) {
			ctx := context.Background()
			rec := &outboxtest.Recorder{}
			set, err := tenant.New(tenant.Config{Resolver: tenant.FromMetadata("tenant"), NackUnresolved: true}) // every message names its member
			if err != nil {
				t.Fatal(err)
			}
			pools := map[string]*pgxpool.Pool{}
			for _, name := range []string{"a", "b"} {
				pool := openPool(t, pgtest.DSN(t), 4, nil)
				ob, err := outboxpgx.New(pool, outbox.Config{Publisher: rec}, outboxpgx.WithConcurrency(mode))
				if err != nil {
					t.Fatal(err)
				}
				t.Cleanup(func() { _ = ob.Close() })
				if err := ob.Migrate(ctx); err != nil {
					t.Fatal(err)
				}
				if _, err := pool.Exec(ctx, `CREATE TABLE orders (id text, tenant text)`); err != nil {
					t.Fatal(err)
				}
				if err := set.Add(name, ob); err != nil {
					t.Fatal(err)
				}
				pools[name] = pool
			}
			var mu sync.Mutex
			runs := map[string]int{}
			h := set.WrapConsumer(func(msg *message.Message) error {
				mu.Lock()
				runs[msg.UUID]++
				mu.Unlock()
				ctx := msg.Context()
				if _, err := outboxpgx.Tx(ctx).Exec(ctx, `INSERT INTO orders VALUES ($1, $2)`, msg.UUID, msg.Metadata.Get("tenant")); err != nil {
					return err
				}
				return outbox.Publish(ctx, "events", message.NewMessage("event-"+msg.UUID, nil))
			}, middleware.WithConsumer("shop"))
			var wg sync.WaitGroup
			for i := range 16 {
				wg.Add(1)
				go func() {
					defer wg.Done()
					tn := []string{"a", "b"}[i%2]
					id := fmt.Sprintf("%s-%d", tn, i/4) // each message twice: a copy at the same moment
					msg := message.NewMessage(id, nil)
					msg.Metadata.Set("tenant", tn)
					if err := h(msg); err != nil {
						t.Errorf("%s: %v", id, err)
					}
				}()
			}
			wg.Wait()
			err = set.Do(ctx, "b", func(ctx context.Context, ob *outbox.Outbox) error {
				return outboxpgx.InTx(ctx, ob, func(ctx context.Context, tx pgx.Tx) error {
					if _, err := tx.Exec(ctx, `INSERT INTO orders VALUES ('b-api', 'b')`); err != nil {
						return err
					}
					return outbox.Publish(ctx, "events", message.NewMessage("event-b-api", nil))
				})
			})
			if err != nil {
				t.Fatal(err)
			}
			want := map[string][]string{"a": {"a-0", "a-1", "a-2", "a-3"}, "b": {"b-0", "b-1", "b-2", "b-3", "b-api"}}
			for tn, ids := range want {
				got := map[string]int{}
				rows, err := pools[tn].Query(ctx, `SELECT id, tenant FROM orders`)
				if err != nil {
					t.Fatal(err)
				}
				for rows.Next() {
					var id, owner string
					if err := rows.Scan(&id, &owner); err != nil {
						t.Fatal(err)
					}
					if owner != tn {
						t.Errorf("%s's database holds an order of %s: %s", tn, owner, id)
					}
					got[id]++
				}
				if err := rows.Err(); err != nil {
					t.Fatal(err)
				}
				if len(got) != len(ids) {
					t.Errorf("%s's database holds %v, want %v once each", tn, got, ids)
				}
				for _, id := range ids {
					if got[id] != 1 {
						t.Errorf("%s: order %s stored %d times", tn, id, got[id])
					}
					// Optimistic: a copy at the same moment runs the handler too, and rolls
					// back at its claim.
					if id != "b-api" && (runs[id] < 1 || mode == outboxpgx.Pessimistic && runs[id] != 1) {
						t.Errorf("the handler ran %d times for %s", runs[id], id)
					}
				}
			}
			sent := map[string]bool{}
			for _, s := range rec.All() {
				sent[s.Message.UUID] = true
			}
			for _, ids := range want {
				for _, id := range ids {
					if !sent["event-"+id] {
						t.Errorf("the event of %s did not go out", id)
					}
				}
			}
		})
	}
}

// The crash matrix over a Set of pgx members (internal/settest), in both modes: two tenants with a
// database each, or a TablePrefix each on one pool, one of them crashing at every step.
func TestTenantSetCrashMatrix(t *testing.T) {
	for name, mode := range map[string]outboxpgx.Concurrency{"pessimistic": outboxpgx.Pessimistic, "optimistic": outboxpgx.Optimistic} {
		t.Run(name, func(t *testing.T) {
			member := func(t *testing.T, pool *pgxpool.Pool, prefix string, pub message.Publisher, fp func(context.Context, string) error) settest.Member {
				ctx := context.Background()
				ob, err := outboxpgx.New(pool, outbox.Config{Publisher: pub, TablePrefix: prefix, RelayInterval: 50 * time.Millisecond,
					RetryDelay: time.Millisecond, Failpoint: fp}, outboxpgx.WithConcurrency(mode))
				if err != nil {
					t.Fatal(err)
				}
				t.Cleanup(func() { _ = ob.Close() })
				if err := ob.Migrate(ctx); err != nil {
					t.Fatal(err)
				}
				table := prefix + "orders"
				if _, err := pool.Exec(ctx, `CREATE TABLE `+table+` (id text, tenant text)`); err != nil {
					t.Fatal(err)
				}
				return settest.Member{
					Ob: ob,
					Insert: func(ctx context.Context, id, tn string) error {
						_, err := outboxpgx.Tx(ctx).Exec(ctx, `INSERT INTO `+table+` VALUES ($1, $2)`, id, tn)
						return err
					},
					Orders: func(ctx context.Context) (map[string][]string, error) {
						rows, err := pool.Query(ctx, `SELECT id, tenant FROM `+table)
						if err != nil {
							return nil, err
						}
						defer rows.Close()
						got := map[string][]string{}
						for rows.Next() {
							var id, tn string
							if err := rows.Scan(&id, &tn); err != nil {
								return nil, err
							}
							got[id] = append(got[id], tn)
						}
						return got, rows.Err()
					},
				}
			}
			var mu sync.Mutex
			shared := map[*testing.T]*pgxpool.Pool{} // the schemas layout's one pool per scenario
			settest.CrashMatrix(t, map[string]settest.NewMember{
				"databases": func(t *testing.T, _ string, pub message.Publisher, fp func(context.Context, string) error) settest.Member {
					return member(t, openPool(t, pgtest.DSN(t), 8, nil), "", pub, fp)
				},
				"schemas": func(t *testing.T, name string, pub message.Publisher, fp func(context.Context, string) error) settest.Member {
					mu.Lock()
					pool := shared[t]
					if pool == nil {
						pool = openPool(t, pgtest.DSN(t), 8, nil)
						shared[t] = pool
					}
					mu.Unlock()
					return member(t, pool, name+"_", pub, fp)
				},
			}, mode == outboxpgx.Pessimistic)
		})
	}
}

// The pgx form's boundary on a member (set.Do with outboxpgx.InTx) stamps the member's name under
// Config.Metadata on what it publishes, as the database/sql form's InTx does; a message that sets
// the key itself keeps its own.
func TestTenantSetStampsPgxInTx(t *testing.T) {
	for name, mode := range map[string]outboxpgx.Concurrency{"pessimistic": outboxpgx.Pessimistic, "optimistic": outboxpgx.Optimistic} {
		t.Run(name, func(t *testing.T) {
			ctx := context.Background()
			rec := &outboxtest.Recorder{}
			set, err := tenant.New(tenant.Config{Metadata: "tenant", NackUnresolved: true})
			if err != nil {
				t.Fatal(err)
			}
			for _, tn := range []string{"a", "b"} {
				ob, err := outboxpgx.New(openPool(t, pgtest.DSN(t), 4, nil), outbox.Config{Publisher: rec}, outboxpgx.WithConcurrency(mode))
				if err != nil {
					t.Fatal(err)
				}
				t.Cleanup(func() { _ = ob.Close() })
				if err := ob.Migrate(ctx); err != nil {
					t.Fatal(err)
				}
				if err := set.Add(tn, ob); err != nil {
					t.Fatal(err)
				}
			}
			for _, tn := range []string{"a", "b"} {
				err := set.Do(ctx, tn, func(ctx context.Context, ob *outbox.Outbox) error {
					return outboxpgx.InTx(ctx, ob, func(ctx context.Context, _ pgx.Tx) error {
						own := message.NewMessage(tn+"-own", nil)
						own.Metadata.Set("tenant", "elsewhere")
						return outbox.Publish(ctx, "events", message.NewMessage(tn+"-api", nil), own)
					})
				})
				if err != nil {
					t.Fatalf("%s: %v", tn, err)
				}
			}
			want := map[string]string{"a-api": "a", "b-api": "b", "a-own": "elsewhere", "b-own": "elsewhere"}
			got := map[string]string{}
			for _, s := range rec.All() {
				got[s.Message.UUID] = s.Message.Metadata.Get("tenant")
			}
			for uuid, tn := range want {
				if v, ok := got[uuid]; !ok {
					t.Errorf("%s did not go out", uuid)
				} else if v != tn {
					t.Errorf("%s went out with tenant %q, want %q", uuid, v, tn)
				}
			}
		})
	}
}

// TestTenantSetRefusesPgxMembersOnOneSetOfTables: each pgx Outbox wraps the pool in a *sql.DB of
// its own, so two members on one pool and one set of tables were taken for members of two
// databases, and their claims would have acked each other's messages as duplicates.
func TestTenantSetRefusesPgxMembersOnOneSetOfTables(t *testing.T) {
	pool := openPool(t, pgtest.DSN(t), 4, nil)
	open := func(prefix string) *outbox.Outbox {
		ob, err := outboxpgx.New(pool, outbox.Config{Publisher: &outboxtest.Recorder{}, TablePrefix: prefix})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = ob.Close() })
		return ob
	}
	set, err := tenant.New(tenant.Config{Resolver: tenant.FromMetadata("tenant"), NackUnresolved: true})
	if err != nil {
		t.Fatal(err)
	}
	if err := set.Add("a", open("")); err != nil {
		t.Fatal(err)
	}
	if err := set.Add("b", open("")); err == nil || !strings.Contains(err.Error(), `its tables are member "a"'s`) {
		t.Errorf("Add of a second pgx member on the pool and tables of the first = %v, want it refused", err)
	}
	if err := set.Add("c", open("c_")); err != nil {
		t.Errorf("Add of a pgx member with tables of its own: %v", err)
	}
}
